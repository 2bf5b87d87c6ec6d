"""Dockerfiles, pure: parse (:mod:`.parser`), type and check the instructions
(:mod:`.instructions`), expand variables as Docker does (:mod:`.lexer`) and plan the
build (:mod:`.plan`). No I/O: the build itself is :mod:`hutch.services.image_builder`.
"""

from __future__ import annotations

from hutch.images.dockerfile.instructions import SUPPORTED, UNSUPPORTED, Instruction, typed_all
from hutch.images.dockerfile.lexer import Expander, ExpansionError, split_words
from hutch.images.dockerfile.parser import Dockerfile, RawInstruction, parse
from hutch.images.dockerfile.plan import (
    DEFAULT_PATH,
    BaseConfig,
    CopyPlan,
    ImageConfigPlan,
    Plan,
    RunPlan,
    Step,
    base_reference,
    check_build_args,
    evaluate,
)

__all__ = [
    "DEFAULT_PATH",
    "SUPPORTED",
    "UNSUPPORTED",
    "BaseConfig",
    "CopyPlan",
    "Dockerfile",
    "Expander",
    "ExpansionError",
    "ImageConfigPlan",
    "Instruction",
    "Plan",
    "RawInstruction",
    "RunPlan",
    "Step",
    "base_reference",
    "check_build_args",
    "evaluate",
    "parse",
    "split_words",
    "typed_all",
]
