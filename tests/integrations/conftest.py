"""Settings for the integration tests: Hugging Face stays offline (the tiny models
are built from configs, ``tests/_helpers/hf_models.py``), before any test imports
transformers."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
