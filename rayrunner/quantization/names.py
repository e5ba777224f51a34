"""mistral.rs in-situ quantization (ISQ) names and their parse into an `IsqLevel`.

The names are mistral.rs's: GGUF block types (`Q4_0` ... `Q8K`), HQQ levels, `FP8`, and bare bit widths
(`2 3 4 5 6 8`) that leave the format to the backend. Parsing is case-insensitive; what each level becomes on a
given device is the backend's business (see `torchao_backend`).
"""

from __future__ import annotations

from dataclasses import dataclass

from rayrunner.errors import InvalidSpecError


@dataclass(frozen=True)
class IsqLevel:
    """One ISQ level: its canonical name, the weight bits it asks for, and whether those bits are a float format."""

    name: str
    bits: int
    is_float: bool = False


_LEVELS: tuple[IsqLevel, ...] = (
    IsqLevel("Q4_0", 4),
    IsqLevel("Q4_1", 4),
    IsqLevel("Q5_0", 5),
    IsqLevel("Q5_1", 5),
    IsqLevel("Q8_0", 8),
    IsqLevel("Q8_1", 8),
    IsqLevel("Q2K", 2),
    IsqLevel("Q3K", 3),
    IsqLevel("Q4K", 4),
    IsqLevel("Q5K", 5),
    IsqLevel("Q6K", 6),
    IsqLevel("Q8K", 8),
    IsqLevel("HQQ4", 4),
    IsqLevel("HQQ8", 8),
    IsqLevel("FP8", 8, is_float=True),
    *(IsqLevel(str(bits), bits) for bits in (2, 3, 4, 5, 6, 8)),
)
_BY_NAME: dict[str, IsqLevel] = {level.name: level for level in _LEVELS}
VALID_NAMES: tuple[str, ...] = tuple(_BY_NAME)


def parse_isq(name: str | int) -> IsqLevel:
    """The level named `name` (any case, or an int bit width); InvalidSpecError listing valid names otherwise."""
    level = _BY_NAME.get(str(name).strip().upper())
    if level is None:
        raise InvalidSpecError(
            f"unknown in_situ_quant `{name}`; valid names are: {', '.join(VALID_NAMES)}", param="in_situ_quant"
        )
    return level
