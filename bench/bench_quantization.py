"""ISQ benchmark on the builtin SmolLM2: weight bytes, perplexity, decode speed, load and quantize time per level.

Run: `python bench/bench_quantization.py` (add `--isq Q6K Q2K` for more levels, `--degrid` for the check below).

Perplexity is measured on a fixed English text embedded here (~1.4k tokens, one forward pass: it fits the
context). Bytes count the tied embedding / lm_head once (see `rayrunner.quantization.weights`). Decode speed goes
through rayrunner's engine (`TextEngine.chat`, so the step scheduler runs the model as it does when serving):
`--batches` concurrent greedy chats of `--tokens` tokens each, aggregate tok/s over the whole requests, the median
of `--rounds` rounds that alternate the levels, so that every level sees the same machine load.

Caveat: the builtin SmolLM2 is dequantized from a Q4_1 GGUF (Q8_0 embedding), so its Linear weights already sit on
an asymmetric 4-bit grid in blocks of 32. int4 with groups of 32 re-finds that grid almost exactly and looks nearly
lossless. `--degrid` adds uniform noise of half a Q4_1 step to every Linear weight first, a rough stand-in for a
checkpoint that was never 4-bit, and measures the ratios against that noisy bf16 baseline instead.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from cpu_kind import cpu_line
from transformers import AutoModelForCausalLM, AutoTokenizer

from rayrunner.models.sources import SMOLLM2, resolve
from rayrunner.quantization import quantize_model, weight_bytes

# Targets from the issue: (max bytes ratio, max perplexity ratio) against bf16.
TARGETS = {"Q4K": (0.45, 1.15), "Q8_0": (0.62, 1.01)}
Q4_1_BLOCK = 32
CITIES = ("Paris", "Rome", "Vienna", "Prague", "Lisbon", "Madrid", "Berlin", "Warsaw", "Athens", "Dublin", "Oslo",
          "Bern", "Budapest", "Riga", "Sofia", "Zagreb")

TEXT = """\
The river valleys of Europe have shaped the lives of the people who settled along them for thousands of
years. Long before the first cities were built, small groups of farmers followed the rivers inland from the
coast, clearing forests and planting wheat and barley on the rich soil left behind by seasonal floods. The
Rhine, the Danube and the Rhone carried boats, goods and ideas from one region to another, and the towns
that grew up at their crossings became markets where people traded salt, grain, wool and metal tools.

In the south, the Mediterranean Sea joined the coasts of three continents. Greek sailors founded colonies
from the shores of the Black Sea to the coast of Spain, and each colony kept close ties with its mother
city. Olive oil, wine and painted pottery travelled in one direction, while timber, grain and silver
travelled in the other. Later, the Romans built a network of paved roads that connected the provinces of
their empire to the capital. Many of these roads are still used today, and the straight lines they drew
across the landscape can be seen from the air.

The climate of a region decides what its people can grow and how they build their homes. Along the Atlantic
coast, the weather is mild and wet, and the winds that blow in from the ocean bring rain throughout the
year. Farmers there raise cattle and sheep on green pastures, and the houses are built of stone with steep
roofs that let the rain run off quickly. Further east, the winters are longer and colder, and the summers
are hot and dry. On the wide plains of central and eastern Europe, farmers grow wheat, maize and sunflowers,
and the villages are often spread out along a single main road.

Mountains have always been both a barrier and a meeting place. The Alps divide the north of the continent
from the south, and for centuries only a few passes allowed travellers to cross them. Merchants, pilgrims
and armies all used these narrow routes, and the small towns at the foot of each pass grew wealthy by
offering food, shelter and guides. In the nineteenth century, engineers began to dig long tunnels through
the mountains, and the railways that followed made it possible to travel from one side to the other in a few
hours instead of several days.

The growth of cities changed the way people lived and worked. In the Middle Ages, most towns were small and
surrounded by walls, and the market square was the centre of daily life. Craftsmen organised themselves into
guilds that set prices, trained apprentices and protected the quality of their work. As trade increased,
some towns became very rich, and their leaders built cathedrals, town halls and bridges that still stand
today. Paris, the capital of France, grew on the banks of the Seine around a small island where the
cathedral of Notre Dame was built. London grew along the Thames, where ships could sail up the river from
the sea and unload their goods at the docks.

The industrial revolution began in Britain in the eighteenth century and spread across the continent during
the next hundred years. Factories were built near coal fields and rivers, and millions of people moved from
the countryside to the growing cities in search of work. Canals and railways carried coal, iron and cotton,
and new machines made it possible to produce cloth, tools and household goods faster and more cheaply than
ever before. Life in the new industrial towns was often hard. Workers lived in crowded houses with little
light or fresh air, and children worked long hours in the mills. Over time, reformers fought for shorter
working days, better housing, clean water and free schools for all children.

Islands and coastlines have their own history. The people of the northern islands lived by fishing and by
raising sheep on the few fields that could be farmed. Their boats were small but strong, and their sailors
knew how to read the weather and the tides. In the south, island harbours served as ports for ships that
crossed the sea between Europe, Africa and Asia. Each new group of traders or rulers left something behind,
whether it was a style of building, a new crop or a few words that entered the local language.

Languages themselves tell a story about movement and contact. Many of the languages spoken in Europe today
share a common ancestor, and words for family members, numbers and animals often look alike from one
language to the next. Other languages arrived later or developed on their own, and in some valleys people
still speak a dialect that their neighbours on the other side of the mountain can barely understand. Place
names also preserve traces of the past. A town whose name ends in a certain way may once have been a Roman
camp, while a river may keep a name given to it by people who lived there long before any written records
were kept.

Forests once covered most of the continent. Over many centuries, people cut down trees to make room for
fields, to build houses and ships, and to burn for heat. By the end of the Middle Ages, large areas had been
cleared, and in some countries wood became so scarce that laws were passed to protect what remained. In the
modern period, many countries began to plant new forests, and today the area covered by trees is growing
again in several parts of Europe. These forests provide wood, shelter for wild animals and places where
people can walk and rest.

Rivers and lakes have also changed. Engineers straightened rivers to make them easier for ships to use and
built dams to produce electricity and to control floods. These projects brought benefits, but they also
changed the habitats of fish and birds and sometimes made floods worse further downstream. In recent years,
some towns have begun to restore the natural banks of their rivers, allowing them to spread out across
meadows during high water and giving wildlife a place to return.

Travel today is faster than at any time in history. High speed trains link the major cities, and a journey
that once took a week can now be made in an afternoon. Yet the old patterns remain visible. Cities still
stand where rivers can be crossed, ports still grow where ships can find shelter, and the farms on the
plains still depend on the rain that comes from the sea. To understand a place, it helps to look at its map:
the shape of the land, the course of its rivers and the height of its mountains explain much about the lives
of the people who have lived there, both in the past and in the present.

Schools and universities also played a large part in the history of the continent. The first universities
were founded in the Middle Ages in cities such as Bologna, Paris and Oxford, where students came from many
countries to study law, medicine and theology. Teachers and students spoke and wrote in Latin, which allowed
them to move from one university to another without learning a new language. Printing, which spread quickly
after the middle of the fifteenth century, made books cheaper and easier to find, and ideas that once
travelled slowly from one monastery to the next could now reach readers in many towns within a few months.
"""


@dataclass
class Row:
    level: str
    weight_bytes: int
    perplexity: float
    load_seconds: float
    quantize_seconds: float
    applied: str
    tokens_per_second: dict[int, float] = field(default_factory=dict)  # by number of concurrent chats


def degrid(model: Any) -> None:
    """Add uniform noise of +-half a Q4_1 step (per block of 32) to every Linear weight of the decoder layers."""
    generator = torch.Generator().manual_seed(0)
    for module in model.model.layers.modules():
        if isinstance(module, torch.nn.Linear):
            weight = module.weight.data
            blocks = weight.float().view(weight.shape[0], -1, Q4_1_BLOCK)
            step = (blocks.amax(-1, keepdim=True) - blocks.amin(-1, keepdim=True)) / 15
            noise = (torch.rand(blocks.shape, generator=generator) - 0.5) * step
            module.weight.data = (blocks + noise).view_as(weight).to(weight.dtype)


def prose() -> str:
    """TEXT with its source line wraps undone: paragraphs of plain prose separated by blank lines."""
    return "\n\n".join(" ".join(paragraph.split()) for paragraph in TEXT.split("\n\n"))


def import_torchao_now() -> None:
    """Import torchao before any timing, so its one-off import cost is not charged to the first level."""
    import rayrunner.quantization.torchao_backend  # noqa: F401


def perplexity(model: Any, ids: torch.Tensor) -> float:
    with torch.inference_mode():
        return math.exp(model(ids, labels=ids).loss.item())


def measure(folder: str, level: str, ids: torch.Tensor, noisy: bool) -> Row:
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    load_seconds = time.perf_counter() - start
    if noisy:
        degrid(model)
    start = time.perf_counter()
    applied = quantize_model(model, level, "cpu")["applied"] if level != "bf16" else "bf16 (no quantization)"
    quantize_seconds = time.perf_counter() - start
    return Row(level, weight_bytes(model), perplexity(model, ids), load_seconds, quantize_seconds, applied)


async def chats(engine: Any, streams: int, tokens: int) -> float:
    """Aggregate tok/s of `streams` concurrent greedy chats of `tokens` tokens on `engine`."""
    from rayrunner.openai.sampling_params import SamplingParams
    from rayrunner.protocol import ChatCompletionRequest

    async def one(city: str) -> int:
        request = ChatCompletionRequest(messages=[{"role": "user", "content": f"Tell me about the history of {city}."}])
        events = [event async for event in engine.chat(request, SamplingParams(max_tokens=tokens))]
        return events[-1].completion_tokens

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(CITIES[i % len(CITIES)]) for i in range(streams)))
    return sum(counts) / (time.perf_counter() - start)


def decode_speeds(rows: list[Row], batches: list[int], tokens: int, rounds: int) -> None:
    """Fill each row's tokens_per_second, alternating the levels within each round (after one warm-up round). Each
    level's engine is loaded for its turn and closed after it: two engines' compute threads in one process slow each
    other down (see `rayrunner.engines.transformers.step.compute_thread`), and a replica holds one."""
    from rayrunner.engines.transformers.text import TextEngine
    from rayrunner.models.spec import build_spec

    which = {"type": "plain", "model_id": SMOLLM2}
    samples: dict[tuple[str, int], list[float]] = {}
    loop = asyncio.new_event_loop()
    try:
        for round_ in range(rounds + 1):
            for row in rows:
                engine = TextEngine(build_spec(f"smollm2-{row.level}", which,
                                               in_situ_quant=None if row.level == "bf16" else row.level))
                try:
                    for streams in batches:
                        speed = loop.run_until_complete(chats(engine, streams, tokens))
                        if round_:
                            samples.setdefault((row.level, streams), []).append(speed)
                finally:
                    engine.close()
    finally:
        loop.close()
    for row in rows:
        row.tokens_per_second = {streams: statistics.median(samples[row.level, streams]) for streams in batches}


def verdict(row: Row, base: Row) -> str:
    if row.level not in TARGETS:
        return ""
    max_bytes, max_ppl = TARGETS[row.level]
    ok = row.weight_bytes / base.weight_bytes <= max_bytes and row.perplexity / base.perplexity <= max_ppl
    return f"{'meets' if ok else 'MISSES'} <={max_bytes}x bytes, ppl <=+{round((max_ppl - 1) * 100)}%"


def print_table(rows: list[Row]) -> None:
    base = rows[0]
    speeds = "".join(f" {f'tok/s x{streams}':>11} {'vs bf16':>7}" for streams in base.tokens_per_second)
    print(f"{'level':6} {'MiB':>6} {'vs bf16':>7} {'ppl':>7} {'vs bf16':>7}{speeds} {'load s':>6} {'quant s':>7}"
          "  applied; target")
    for row in rows:
        speeds = "".join(f" {tps:11.1f} {tps / base.tokens_per_second[streams]:6.2f}x"
                         for streams, tps in row.tokens_per_second.items())
        print(f"{row.level:6} {row.weight_bytes / 2**20:6.1f} {row.weight_bytes / base.weight_bytes:6.3f}x "
              f"{row.perplexity:7.3f} {row.perplexity / base.perplexity:6.3f}x{speeds} "
              f"{row.load_seconds:6.2f} {row.quantize_seconds:7.2f}  {row.applied}; {verdict(row, base) or '-'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--isq", nargs="*", default=["Q8_0", "Q4K"], help="ISQ levels to compare with bf16")
    parser.add_argument("--degrid", action="store_true", help="move the weights off the Q4_1 grid first")
    parser.add_argument("--batches", nargs="*", type=int, default=[1, 16], help="concurrent chats per measurement")
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per chat")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (the median is shown)")
    args = parser.parse_args()
    import_torchao_now()
    folder = resolve(SMOLLM2).path
    ids = AutoTokenizer.from_pretrained(folder)(prose(), return_tensors="pt").input_ids
    print(f"{cpu_line()}\nSmolLM2-135M-Instruct, CPU, {torch.get_num_threads()} threads, {ids.shape[1]} tokens"
          f"{', de-gridded' if args.degrid else ''}; decode: {args.tokens} greedy tokens per chat, median of "
          f"{args.rounds}")
    rows = [measure(folder, level, ids, args.degrid) for level in ["bf16", *args.isq]]
    if args.batches:
        decode_speeds(rows, args.batches, args.tokens, args.rounds)
    print_table(rows)


if __name__ == "__main__":
    main()
