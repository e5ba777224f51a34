"""ISQ name parsing: mistral.rs names, any case, bare bit widths, and a helpful error for anything else."""

from __future__ import annotations

import dataclasses

import pytest

from rayrunner.errors import InvalidSpecError
from rayrunner.quantization import VALID_NAMES, parse_isq

MISTRALRS_NAMES = [
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q8_1", "Q2K", "Q3K", "Q4K", "Q5K", "Q6K", "Q8K", "HQQ4", "HQQ8", "FP8",
    "2", "3", "4", "5", "6", "8",
]


def test_valid_names_are_exactly_mistralrs_names() -> None:
    assert sorted(VALID_NAMES) == sorted(MISTRALRS_NAMES)


@pytest.mark.parametrize("name", MISTRALRS_NAMES)
def test_every_name_parses_in_any_case(name: str) -> None:
    assert parse_isq(name).name == name
    assert parse_isq(name.lower()).name == name


@pytest.mark.parametrize(
    ("name", "canonical", "bits"),
    [("q4k", "Q4K", 4), ("Hqq8", "HQQ8", 8), ("q2k", "Q2K", 2), ("q6k", "Q6K", 6), (" q8_0 ", "Q8_0", 8)],
)
def test_canonical_name_and_bits(name: str, canonical: str, bits: int) -> None:
    level = parse_isq(name)
    assert (level.name, level.bits) == (canonical, bits)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_numeric_names_as_int_and_str(bits: int) -> None:
    assert parse_isq(bits) == parse_isq(str(bits))
    assert (parse_isq(bits).name, parse_isq(bits).bits) == (str(bits), bits)


def test_fp8_is_a_float_format() -> None:
    assert parse_isq("fp8").is_float
    assert not parse_isq("Q8_0").is_float


def test_level_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        parse_isq("Q4K").bits = 3  # type: ignore[misc]


@pytest.mark.parametrize("name", ["Q7K", "q4", "int4", "", "7", 16])
def test_unknown_name_lists_every_valid_name(name: str | int) -> None:
    with pytest.raises(InvalidSpecError) as caught:
        parse_isq(name)
    error = caught.value
    assert error.status == 400
    assert error.param == "in_situ_quant"
    assert all(valid in error.message for valid in MISTRALRS_NAMES)
