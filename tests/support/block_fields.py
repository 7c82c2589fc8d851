"""Where the float fields of ggml's block types sit (shared by the quantization and native-kernel tests)."""
from __future__ import annotations

from llmfw.core.quants import GGMLType as T

# Byte offsets of the f16 scale fields inside one block: random bytes there must not be NaN/inf.
F16_FIELDS = {T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0], T.Q2_K: [80, 82],
              T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208], T.IQ4_NL: [0], T.IQ4_XS: [0]}
