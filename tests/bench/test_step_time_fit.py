"""The step-time fit: it recovers known coefficients from timings a StepTimeModel generated, and
`python -m roseray.bench step-time` measures a tiny random model on the CPU and writes a model
that routing-sim loads."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import roseray.bench
from roseray.bench.routing_sim_cli import fit_label
from roseray.bench.routing_sim_cli import main as routing_sim_main
from roseray.bench.routing_step_time import COEFFICIENTS, StepShape, StepTimeModel, fit_step_time, nnls
from roseray.bench.step_time_fit import Point, StepBench, build_engine, parse_args
from roseray.bench.step_time_fit import main as step_time_main

TRUE = StepTimeModel(base_s=2.5e-3, token_s=4.0e-6, seq_s=3.0e-6, attn_pair_s=0.7e-9, decode_ctx_s=25e-9,
                     prefill_ctx_s=0.6e-6)


def _grid_shapes() -> list[StepShape]:
    """The shapes of the GPU grid's kinds of steps: prefill chunks after prefixes, decodes, mixed."""
    shapes = []
    for prefix in (0, 2048, 6144):
        for chunk in (128, 512, 2048, 8192):
            shapes.append(StepShape(chunk, 1, chunk * (prefix + chunk / 2), 0, prefix + chunk))
    for context in (256, 1024, 3072):
        for batch in (1, 16, 64, 192):
            shapes.append(StepShape(batch, batch, 0.0, batch * context))
    for batch, context, chunk, prefix in ((32, 1024, 512, 0), (64, 2048, 1024, 4096), (128, 512, 256, 6144)):
        shapes.append(StepShape(batch + chunk, batch + 1, chunk * (prefix + chunk / 2), batch * context,
                                prefix + chunk))
    return shapes


@pytest.mark.parametrize("noise", [0.0, 0.03])
def test_fit_recovers_known_coefficients(noise):
    shapes = _grid_shapes()
    rng = np.random.default_rng(0)
    seconds = [TRUE.shape_seconds(s) * (1 + noise * rng.standard_normal()) for s in shapes]
    model = fit_step_time(shapes, seconds, source="synthetic")
    # seq_s is small beside the others (a decode's token_s + decode context): looser
    for name, tolerance in zip(COEFFICIENTS, (0.05, 0.1, 0.6, 0.05, 0.05, 0.1), strict=True):
        truth = getattr(TRUE, name)
        assert abs(getattr(model, name) - truth) <= (tolerance * truth if noise else 1e-6 * truth), name
    assert model.fit_points == len(shapes) and model.source == "synthetic"
    assert model.fit_rel_err_p50 <= model.fit_rel_err_p90 <= model.fit_rel_err_max
    assert model.fit_rel_err_max < (1e-6 if not noise else 4 * noise)


def test_fit_keeps_coefficients_non_negative():
    """A term the timings do not grow with gets 0, not a negative coefficient that would fit noise."""
    shapes = _grid_shapes()
    flat = StepTimeModel(base_s=1e-3, token_s=5e-6, seq_s=0.0, attn_pair_s=1e-9, decode_ctx_s=0.0)
    seconds = [flat.shape_seconds(s) * (0.98 if s.num_sampled > 1 else 1.0) for s in shapes]
    model = fit_step_time(shapes, seconds)
    assert all(getattr(model, name) >= 0 for name in COEFFICIENTS)
    a = np.array([[1.0, 0.0], [1.0, 1.0], [1.0, 2.0]])
    assert np.allclose(nnls(a, np.array([3.0, 2.0, 1.0])), [2.0, 0.0])  # unconstrained: slope -1


def test_cli_measures_a_tiny_model_and_routing_sim_loads_the_fit(tmp_path, capsys):
    out, report = tmp_path / "fit.json", tmp_path / "points.json"
    assert step_time_main(["--model", "random:tiny", "--device", "cpu", "--prefill", "32:0,64:32", "--decode",
                           "2:32,6:64", "--mixed", "4:48:32:16", "--steps", "2", "--repeats", "2", "--warmup", "1",
                           "--out", str(out), "--report", str(report)]) == 0
    printed = capsys.readouterr().out
    assert "| mixed | B4xL48 C32+P16 |" in printed and "relative error p50" in printed
    model = StepTimeModel.from_json(out)
    assert model.fit_points == 5 and "random:tiny" in model.source and "CPU" in model.source
    assert all(getattr(model, name) >= 0 for name in COEFFICIENTS)
    points = json.loads(report.read_text())["points"]
    by_label = {(p["decodes"], p["context"], p["chunk"], p["prefix"]): p for p in points}
    # the steps were the shapes asked for: the prefix came from the prefix cache, the decodes ran
    assert by_label[(0, 0, 64, 32)]["attn_pairs"] == 64 * (32 + 32)
    assert by_label[(6, 64, 0, 0)]["num_tokens"] == 6 and by_label[(6, 64, 0, 0)]["decode_context"] >= 6 * 65
    mixed = by_label[(4, 48, 32, 16)]
    assert mixed["num_tokens"] == 36 and mixed["attn_pairs"] == 32 * (16 + 16)
    assert all(p["measured_s"] > 0 for p in points)
    assert routing_sim_main(["--replicas", "2", "--qps-per-replica", "2", "--duration", "2", "--policies", "random",
                             "--step-model", str(out)]) == 0
    assert model.source in capsys.readouterr().out


def test_model_json_stays_strict(tmp_path):
    path = tmp_path / "typo.json"
    path.write_text(json.dumps({"base_s": 1e-3, "tokens_s": 1e-6}))
    with pytest.raises(ValueError, match="tokens_s"):
        StepTimeModel.from_json(path)


def test_a_point_steps_only_its_windows_and_leaves_the_decodes_running():
    """A decode point must not run its group's decodes to their end (max_model_len away) before the
    next point: only warmup + repeats * steps engine steps, and the decodes still there afterwards."""
    args = parse_args(["--model", "random:tiny", "--device", "cpu"])
    points = [Point(decodes=3, context=32), Point(decodes=3, context=32, chunk=16)]
    bench = StepBench(build_engine(args, points, decode_tokens=64), steps=2, repeats=2, warmup=1)
    ids = bench.start_decodes(3, 32, max_tokens=bench.engine.max_model_len - 32)
    for point in points:
        before = len(bench.recorder.shapes)
        bench.measure(point)
        assert len(bench.recorder.shapes) - before == 1 + 2 * 2
        assert all(request_id in bench.engine.requests for request_id in ids)
    bench.stop(ids)
    assert not bench.engine.has_unfinished_requests()


@pytest.mark.parametrize("name", ["h100-qwen3-0.6b", "h100-llama-8b"])
def test_the_shipped_h100_fits_load(name):
    model = StepTimeModel.from_json(Path(roseray.bench.__file__).parent / "fits" / f"{name}.json")
    assert model.fit_points == 27 and "H100" in model.source and name.split("-", 1)[1] in model.source
    assert model.fit_rel_err_p50 < 0.1 and model.token_s > 0 and model.decode_ctx_s > 0
    assert fit_label(model) == f"step-time fit: {name.split('-', 1)[1]}, 27 points"  # the plots' title
