"""Three-stage transfer of a teacher into a head-wise FA/GDN hybrid (SPEC.md §9)."""

from .data import Loader, TokenRows, corpus_documents, format_rows, mix, pack, retrieval_rows, sample_teacher_text, stage_rows
from .fast import FastStep, flops_per_token, model_body
from .fused_loss import linear_ce_loss, linear_kl_loss
from .stages import alignment_loss, distillation_loss, lm_loss, stage_loss, trainable_parameters
from .pipeline import DataConfig, build_rows, convert_stage, load_student
from .trainer import StopTraining, TrainConfig, Trainer, cosine_lambda

__all__ = [
    "DataConfig",
    "FastStep",
    "Loader",
    "StopTraining",
    "TokenRows",
    "TrainConfig",
    "Trainer",
    "alignment_loss",
    "build_rows",
    "convert_stage",
    "corpus_documents",
    "cosine_lambda",
    "distillation_loss",
    "flops_per_token",
    "format_rows",
    "linear_ce_loss",
    "linear_kl_loss",
    "lm_loss",
    "load_student",
    "model_body",
    "mix",
    "pack",
    "retrieval_rows",
    "sample_teacher_text",
    "stage_loss",
    "stage_rows",
    "trainable_parameters",
]
