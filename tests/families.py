"""Tiny random models of every adapter family (see headscope.arch.random_models)."""

from headscope.arch.random_models import FAMILIES, SEEDS  # noqa: F401
from headscope.models import random_family as tiny_family  # noqa: F401
