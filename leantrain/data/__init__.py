"""Embedded data (never downloaded): stdlib text, digits, synthetic tasks."""

from leantrain.data.batches import (
    TensorBatches,
    TokenBatches,
    fixed_token_batches,
    sample_windows,
    sample_windows_reference,
)
from leantrain.data.images import (
    ImageSplit,
    load_digits,
    load_image_folder,
    split_fixed,
)
from leantrain.data.shapes import ShapesTask, shape_images
from leantrain.data.synthetic import (
    SEQUENCE_KINDS,
    ClassificationTask,
    RegressionTask,
    SequenceTask,
    sequence_task,
    teacher_classification,
    teacher_student_regression,
)
from leantrain.data.text import (
    STDLIB_MODULES,
    VOCAB_SIZE,
    TextCorpus,
    load_corpus,
    load_stdlib_text,
    load_text,
    split_bytes,
    stdlib_files,
)

__all__ = [
    "SEQUENCE_KINDS",
    "STDLIB_MODULES",
    "VOCAB_SIZE",
    "ClassificationTask",
    "ImageSplit",
    "RegressionTask",
    "SequenceTask",
    "ShapesTask",
    "TensorBatches",
    "TextCorpus",
    "TokenBatches",
    "fixed_token_batches",
    "load_corpus",
    "load_digits",
    "load_image_folder",
    "load_stdlib_text",
    "load_text",
    "sample_windows",
    "sample_windows_reference",
    "sequence_task",
    "shape_images",
    "split_bytes",
    "split_fixed",
    "stdlib_files",
    "teacher_classification",
    "teacher_student_regression",
]
