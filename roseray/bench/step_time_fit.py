"""Measure roseray's engine steps and fit the routing simulator's step-time model to them.

    python -m roseray.bench step-time --model /models/qwen3-0.6b --load-format dummy --out fit.json
    python -m roseray.bench routing-sim --step-model fit.json ...

roseray's real engine (LLMEngine: scheduler, prefix cache, model runner, CUDA graphs, sampler)
runs streams of steps of one controlled shape each, a point of the grid:

- prefill C:P: a chunk of C new tokens after a prefix of P tokens the prefix cache holds (a
  request with the prefix ran first; each measured request is the prefix + C fresh tokens and
  max_tokens 1, the scheduler's token budget is C, so every step is one such chunk);
- decode B:L: B requests decoding at a context of L (prompts of L fresh tokens each);
- mixed B:L:C:P: both at once, the budget B + C (decodes first, then the chunk: the
  scheduler's own order).

What is timed is what the simulator replaces: the wall time of `LLMEngine.step()` in a stream
of such steps, synchronized with the device before the first and after the last of a window
of `--steps` steps: scheduling, input preparation, launches, the device's work and the host's
processing of results. With async scheduling (the default on CUDA, as in serving) a step's
host work overlaps the previous step's device work, so a window's time per step is what a
step costs in steady state; without it (CPU), host and device add up, as they do there too.
Each point: `--warmup` steps, then `--repeats` windows; its time is the median window's time
per step, its shape (step_shape: tokens, sampled sequences, prefill attention pairs, decode
context) the mean of the steps the scheduler actually formed. The fit (fit_step_time:
non-negative least squares on relative error) and each point's measured vs predicted time
are printed; `--out` is the model as JSON (with the fit's error and its source: model,
device, date), `--report` the points.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from statistics import median

import numpy as np
import torch
from tqdm.auto import tqdm

from roseray.bench.routing_step_time import (
    COEFFICIENTS,
    StepShape,
    StepTimeModel,
    fit_step_time,
    relative_errors,
    step_shape,
)
from roseray.config import LOAD_FORMATS, EngineConfig
from roseray.engine.engine import LLMEngine
from roseray.sampling_params import SamplingParams


@dataclass(frozen=True)
class Point:
    """A step shape to measure: `decodes` sequences at context `context`, and a prefill chunk
    of `chunk` tokens after a cached prefix of `prefix` tokens (chunk 0: none)."""

    decodes: int = 0
    context: int = 0
    chunk: int = 0
    prefix: int = 0

    @property
    def kind(self) -> str:
        return "mixed" if self.decodes and self.chunk else ("decode" if self.decodes else "prefill")

    @property
    def label(self) -> str:
        parts = ([f"B{self.decodes}xL{self.context}"] if self.decodes else []) + \
                ([f"C{self.chunk}+P{self.prefix}"] if self.chunk else [])
        return " ".join(parts)


# The GPU grid: chunks 128..8192 after prefixes of 0..6k (a multi-tenant prompt's shape),
# decode batches 1..192 at contexts 256..3072 (at most ~200k tokens of KV), and mixed steps.
GPU_PREFILL = [(c, p) for p in (0, 2048, 6144) for c in (128, 512, 2048, 8192)]
GPU_DECODE = [(b, n) for n in (256, 1024, 3072) for b in (1, 16, 64, 192) if b * n <= 200_000]
GPU_MIXED = [(32, 1024, 512, 0), (64, 2048, 1024, 4096), (128, 512, 256, 6144), (16, 3072, 2048, 2048)]


def default_points() -> list[Point]:
    return ([Point(chunk=c, prefix=p) for c, p in GPU_PREFILL] + [Point(b, n) for b, n in GPU_DECODE]
            + [Point(*m) for m in GPU_MIXED])


def point_list(order: str):
    """An argparse type: "a:b,..." of len(order) numbers each, as Points; `order` names the
    fields ("CP": chunk, prefix; "BL": decodes, context; "BLCP": all)."""
    names = {"B": "decodes", "L": "context", "C": "chunk", "P": "prefix"}

    def parse(text: str) -> list[Point]:
        points = []
        for item in filter(None, text.split(",")):
            try:
                values = [int(v) for v in item.split(":")]
            except ValueError:
                values = []
            if len(values) != len(order):
                raise argparse.ArgumentTypeError(f"{item!r}: expected {':'.join(order)} (integers)")
            points.append(Point(**{names[k]: v for k, v in zip(order, values)}))
        return points

    return parse


@dataclass
class Measurement:
    point: Point
    shape: StepShape
    seconds: float  # per step, the median window
    windows_s: list[float]


class ShapeRecorder:
    """Keeps the shape of every batch the engine's scheduler forms."""

    def __init__(self, engine: LLMEngine) -> None:
        self.shapes: list[StepShape] = []
        scheduler = engine.scheduler
        schedule = scheduler.schedule

        def recorded():
            batch = schedule()
            self.shapes.append(step_shape(batch))
            return batch

        scheduler.schedule = recorded


class StepBench:
    """Drives one engine through the points (see the module docstring)."""

    def __init__(self, engine: LLMEngine, steps: int, repeats: int, warmup: int, seed: int = 0) -> None:
        self.engine, self.steps, self.repeats, self.warmup = engine, steps, repeats, warmup
        self.recorder = ShapeRecorder(engine)
        self.rng = np.random.default_rng(seed)
        self.vocab = engine.model_config.vocab_size
        self.budget = engine.scheduler.max_num_batched_tokens
        self.cuda = engine.device.type == "cuda"
        self.block_size = engine.config.block_size
        self._ids = 0

    def _tokens(self, count: int) -> list[int]:
        return self.rng.integers(1, self.vocab - 1, size=count).tolist()

    def _add(self, prompt: list[int], max_tokens: int) -> str:
        self._ids += 1
        request_id = f"step-time-{self._ids}"
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.engine.add_request(request_id, prompt, params, stream_text=False)
        return request_id

    def _step_until(self, done, limit: int = 100_000) -> None:
        for _ in range(limit):
            if done():
                return
            self.engine.step()
        raise RuntimeError("the engine did not reach the state asked for")

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def start_decodes(self, count: int, context: int, max_tokens: int) -> list[str]:
        ids = [self._add(self._tokens(context), max_tokens) for _ in range(count)]
        requests = [self.engine.requests[i] for i in ids]
        self._step_until(lambda: all(r.output_token_ids for r in requests))
        return ids

    def stop(self, ids: list[str]) -> None:
        """Abort `ids` and step until the engine is idle (every other request must be done too)."""
        for request_id in ids:
            self.engine.abort_request(request_id)
        self._step_until(lambda: not self.engine.has_unfinished_requests())

    def measure(self, point: Point) -> Measurement:
        """One point, its decodes (if any) already running."""
        engine, prefill_ids = self.engine, []
        if point.chunk:
            if point.prefix:
                prefix = self._tokens(point.prefix)
                first = self._add(prefix + self._tokens(1), 1)
                self._step_until(lambda: first not in engine.requests)
            else:
                prefix = []
            count = self.warmup + self.repeats * self.steps + 2
            prefill_ids = [self._add(prefix + self._tokens(point.chunk), 1) for _ in range(count)]
        engine.scheduler.max_num_batched_tokens = max(1, point.decodes + point.chunk)
        try:
            for _ in range(self.warmup):
                engine.step()
            windows, shapes = [], []
            for _ in range(self.repeats):
                mark = len(self.recorder.shapes)
                self._sync()
                started = time.perf_counter()
                for _ in range(self.steps):
                    engine.step()
                self._sync()
                windows.append((time.perf_counter() - started) / self.steps)
                shapes += self.recorder.shapes[mark:]
        finally:
            engine.scheduler.max_num_batched_tokens = self.budget
        for request_id in prefill_ids:  # the group's decodes run on into its next point
            engine.abort_request(request_id)
        mean = StepShape(*(float(np.mean([getattr(s, f) for s in shapes]))
                           for f in ("num_tokens", "num_sampled", "attn_pairs", "decode_context")))
        return Measurement(point, mean, median(windows), windows)

    def run(self, points: list[Point]) -> list[Measurement]:
        """Every point, grouped by their decodes so that each batch of decodes is prefilled once
        (and decodes, up to max_model_len, until the group's last point is done)."""
        groups: dict[tuple[int, int], list[Point]] = {}
        for point in points:
            groups.setdefault((point.decodes, point.context), []).append(point)
        smallest = min((p.chunk for p in points if p.chunk), default=0)
        if smallest:  # first steps of a fresh engine (lazy initialization, kernel compiles): not measured
            self.measure(Point(chunk=smallest))
        results = []
        with tqdm(total=len(points), desc="step-time", unit="point", dynamic_ncols=True) as bar:
            for (decodes, context), group in groups.items():
                group.sort(key=lambda p: (p.chunk, p.prefix))
                ids = self.start_decodes(decodes, context, self.engine.max_model_len - context) if decodes else []
                for point in group:
                    bar.set_postfix_str(point.label)
                    results.append(self.measure(point))
                    bar.update(1)
                self.stop(ids)
        return results


def check_shapes(measurements: list[Measurement]) -> list[str]:
    """Points whose steps were not the shape asked for (the prefix not cached, decodes ended)."""
    problems = []
    for m in measurements:
        p, s = m.point, m.shape
        want_pairs = p.chunk * (p.prefix + p.chunk / 2)
        if abs(s.num_tokens - (p.decodes + p.chunk)) > 0.5 or abs(s.attn_pairs - want_pairs) > 0.01 * want_pairs + 1:
            problems.append(f"{p.label}: steps averaged {s.num_tokens:.0f} tokens and {s.attn_pairs:.3g} "
                            f"attention pairs, asked {p.decodes + p.chunk} and {want_pairs:.3g}")
    return problems


def format_report(model: StepTimeModel, measurements: list[Measurement]) -> str:
    errors = relative_errors(model, [m.shape for m in measurements], [m.seconds for m in measurements])
    lines = ["| kind | point | tokens | measured ms | predicted ms | error |", "|---|---|---|---|---|---|"]
    for m, err in zip(measurements, errors):
        lines.append(f"| {m.point.kind} | {m.point.label} | {m.shape.num_tokens:.0f} | {m.seconds * 1e3:.3f} | "
                     f"{model.shape_seconds(m.shape) * 1e3:.3f} | {err:.1%} |")
    lines.append("")
    for kind in ("prefill", "decode", "mixed"):
        mine = [e for m, e in zip(measurements, errors) if m.point.kind == kind]
        if mine:
            lines.append(f"{kind}: {len(mine)} points, relative error median {np.median(mine):.1%}, "
                         f"max {max(mine):.1%}")
    lines.append(f"all: relative error p50 {model.fit_rel_err_p50:.1%}, p90 {model.fit_rel_err_p90:.1%}, "
                 f"max {model.fit_rel_err_max:.1%} over {model.fit_points} points")
    lines.append("coefficients: " + ", ".join(f"{k} {getattr(model, k):.4g}" for k in COEFFICIENTS))
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m roseray.bench step-time", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:tiny", help="a model directory (config.json) or random:<preset>")
    p.add_argument("--load-format", default="auto", choices=LOAD_FORMATS,
                   help="dummy: random weights in the geometry of a directory holding config.json only")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="default: sized from memory")
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--max-model-len", type=int, default=None, help="default: what the grid needs")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="the engine's buffers (default: the grid's largest step); each point sets its own budget")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--async-scheduling", choices=("auto", "on", "off"), default="auto",
                   help="overlap host work with the device (auto: on for CUDA, as in serving)")
    p.add_argument("--prefill", type=point_list("CP"), metavar="C:P,...",
                   help="chunks of C tokens after cached prefixes of P tokens (P a multiple of the block size)")
    p.add_argument("--decode", type=point_list("BL"), metavar="B:L,...", help="B sequences decoding at context L")
    p.add_argument("--mixed", type=point_list("BLCP"), metavar="B:L:C:P,...",
                   help="both in one step; none of --prefill/--decode/--mixed: the GPU grid (GPU_* here)")
    p.add_argument("--steps", type=int, default=4, help="steps per timed window")
    p.add_argument("--repeats", type=int, default=3, help="timed windows per point (the median is kept)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before a point's windows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the fitted StepTimeModel as JSON here (routing-sim --step-model)")
    p.add_argument("--report", help="write every point's shape, measured and predicted time as JSON here")
    return p.parse_args(argv)


def build_engine(args: argparse.Namespace, points: list[Point], decode_tokens: int) -> LLMEngine:
    needed_len = max(max(p.context + decode_tokens, p.prefix + p.chunk + 16) for p in points)
    engine_args = {"model": args.model, "load_format": args.load_format, "dtype": args.dtype, "device": args.device,
                   "seed": args.seed, "max_num_seqs": max(8, max(p.decodes for p in points) + 4),
                   "max_num_batched_tokens": args.max_num_batched_tokens or max(2048, *(p.decodes + p.chunk
                                                                                          for p in points)),
                   "max_model_len": args.max_model_len or needed_len, "enforce_eager": args.enforce_eager,
                   "enable_prefix_caching": True}
    if args.num_kv_blocks:
        engine_args["num_kv_blocks"] = args.num_kv_blocks
    if args.gpu_memory_utilization:
        engine_args["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.async_scheduling != "auto":
        engine_args["async_scheduling"] = args.async_scheduling == "on"
    return LLMEngine(EngineConfig.from_kwargs(**engine_args))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    points = (args.prefill or []) + (args.decode or []) + (args.mixed or []) or default_points()
    # decodes run through the points of their group: room for the setup steps and theirs
    decode_tokens = 8 + sum(2 + args.warmup + args.repeats * args.steps for p in points if p.decodes)
    engine = build_engine(args, points, decode_tokens)
    device = torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else "CPU"
    started = time.perf_counter()
    measurements = StepBench(engine, args.steps, args.repeats, args.warmup, args.seed).run(points)
    for problem in check_shapes(measurements):
        print(f"warning: {problem}")
    date = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    source = (f"step-time fit: {Path(args.model).name} ({engine.model_config.hf_architecture or 'random'}, "
              f"{str(engine.dtype).removeprefix('torch.')}) on {device}, async scheduling "
              f"{'on' if engine.overlap else 'off'}, {len(points)} points, {date}")
    model = fit_step_time([m.shape for m in measurements], [m.seconds for m in measurements], source)
    print(f"\n{source}, measured in {time.perf_counter() - started:.0f} s\n")
    print(format_report(model, measurements))
    if args.out:
        model.to_json(args.out)
        print(f"\nmodel: {args.out}")
    if args.report:
        rows = [{"kind": m.point.kind, **asdict(m.point), **asdict(m.shape), "measured_s": m.seconds,
                 "windows_s": m.windows_s, "predicted_s": model.shape_seconds(m.shape)} for m in measurements]
        Path(args.report).write_text(json.dumps({"model": asdict(model), "points": rows}, indent=2) + "\n")
        print(f"report: {args.report}")
    return 0
