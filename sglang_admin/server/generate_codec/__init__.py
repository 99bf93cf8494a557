"""The Generate codec of the server: one entry for a Generate call's conversion.

- :func:`generate_from_proto`: a GenerateRequest checked and converted into the rank's
  GenerateReq in one pass (request.py);
- :class:`SampleStreams`: the rank's outputs of that request turned into its answer, sample
  by sample (streams.py, with the proto pieces of response.py).
"""

from sglang_admin.server.generate_codec.request import (
    MAX_CONSTRAINT_CHARS,
    FeatureError,
    Limits,
    generate_from_proto,
    sampling_from_proto,
    stream_interval_of,
)
from sglang_admin.server.generate_codec.streams import SampleStreams

__all__ = [
    "MAX_CONSTRAINT_CHARS",
    "FeatureError",
    "Limits",
    "SampleStreams",
    "generate_from_proto",
    "sampling_from_proto",
    "stream_interval_of",
]
