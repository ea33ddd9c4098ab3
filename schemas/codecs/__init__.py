"""Codecs: how one tensor's values become the payload bytes of a frame.

Every codec has a wire id and, for the parameterised ones, a float argument; both travel
in the frame header, so a receiver needs nothing else to decode. docs/PROTOCOL.md gives
each byte layout. All work is vectorised with numpy; no Python loop runs per value. Where
the optional compiled module ``schemas._kernels`` was built, the hot loops (int8 and sign
encode, every decoder but fp32's and topk's) run there instead, giving the same floats.

One module per codec family; each registers its classes (``base.register``), and importing
this package imports them all. A new codec: a module here with a ``@register``-ed ``Codec``
subclass, and its import below (docs/CODECS.md shows one). Biased codecs (``biased = True``)
are meant to be used with error feedback (``ErrorFeedback``).
"""

from schemas.codecs import floats, int8, qsgd, sign, ternary, topk  # noqa: F401  (each registers its codecs)
from schemas.codecs.base import Codec, CodecError, UnknownCodecId, codec_from_header, known, make_codec, register
from schemas.codecs.bits import BUCKET, compiled, pack_bits, packed_size, unpack_bits
from schemas.codecs.error import relative_error, typical_energy, typical_error
from schemas.codecs.feedback import ErrorFeedback
from schemas.codecs.floats import Fp16, Fp32
from schemas.codecs.int8 import Int8
from schemas.codecs.qsgd import Qsgd
from schemas.codecs.sign import Sign
from schemas.codecs.ternary import Ternary
from schemas.codecs.topk import TopK

CODECS = known()

__all__ = [
    "BUCKET",
    "CODECS",
    "Codec",
    "CodecError",
    "ErrorFeedback",
    "Fp16",
    "Fp32",
    "Int8",
    "Qsgd",
    "Sign",
    "Ternary",
    "TopK",
    "UnknownCodecId",
    "codec_from_header",
    "compiled",
    "known",
    "make_codec",
    "pack_bits",
    "packed_size",
    "register",
    "relative_error",
    "typical_energy",
    "typical_error",
    "unpack_bits",
]
