"""Three-stage transfer of a teacher into a head-wise FA/GDN hybrid (SPEC.md §9)."""

from .data import Loader, TokenRows, corpus_documents, format_rows, mix, pack, retrieval_rows, sample_teacher_text, stage_rows
from .fast import FastStep, flops_per_token, model_body
from .fused_loss import linear_ce_loss, linear_kl_loss
from .stages import alignment_loss, distillation_loss, lm_loss, stage_loss, trainable_parameters
from .pipeline import DataConfig, build_rows, convert_model, convert_stage, load_student
from .model_folder import is_model_folder, load_model_folder, read_record, save_model_folder
from .recipe import ConvertRecipe, parse_tokens, recipe_documents, recipe_rows
from .trainer import StopTraining, TrainConfig, Trainer, cosine_lambda

__all__ = [
    "ConvertRecipe",
    "DataConfig",
    "FastStep",
    "Loader",
    "StopTraining",
    "TokenRows",
    "TrainConfig",
    "Trainer",
    "alignment_loss",
    "build_rows",
    "convert_model",
    "convert_stage",
    "corpus_documents",
    "cosine_lambda",
    "distillation_loss",
    "flops_per_token",
    "format_rows",
    "is_model_folder",
    "linear_ce_loss",
    "linear_kl_loss",
    "lm_loss",
    "load_model_folder",
    "load_student",
    "model_body",
    "mix",
    "pack",
    "parse_tokens",
    "read_record",
    "recipe_documents",
    "recipe_rows",
    "retrieval_rows",
    "sample_teacher_text",
    "save_model_folder",
    "stage_loss",
    "stage_rows",
    "trainable_parameters",
]
