"""What every part of the label check shares: its stage version, its error and the probability tolerance.

LABELCHECK_VERSION versions the code of this whole package: the labelcheck and relabel stages (their Prefect keys
and manifests) and the fold scores (their score manifests) are all computed here.
"""

from __future__ import annotations

from pipeline.codeversion import stage_version
from pipeline.errors import DataError

LABELCHECK_VERSION = stage_version("1", "pipeline.labelcheck")
# Softmax outputs of fp16/bf16 models sum to 1 only to about 1e-3.
PROB_TOL = 1e-3


class LabelCheckError(DataError):
    pass
