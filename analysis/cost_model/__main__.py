"""`python -m analysis.cost_model`: what A-3PO saves at a given scale (docs/cost_model.md).

    python -m analysis.cost_model predict --model qwen2.5-1.5b --device "H800 SXM" \\
        --prompts 256 --samples 4 --prompt-len 120 --response-len 300 --response-max 1024 \\
        --trainer-devices 4 --rollout-devices 4 --bound 2 [--efficiency train=0.3,forward=0.35]
    python -m analysis.cost_model paper
    python -m analysis.cost_model validate BENCHMARK... --fit FIT_BENCHMARK... [--out FILE]
    python -m analysis.cost_model validate-async RUN_DIRS... [--skip 4] [--out FILE]
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import fields, replace
from pathlib import Path

from analysis.cost_model.async_runs import SKIP, async_rows
from analysis.cost_model.devices import device
from analysis.cost_model.phases import PHASES, Efficiency, Hardware, StepShape, phase_seconds
from analysis.cost_model.pipeline import async_step, bounding_side, serial_step, trainer_side
from analysis.cost_model.setting import (SUITE_H200, architecture, implied_by_areal, paper_shape, predictions,
                                          requirements)
from analysis.cost_model.validate import fit, load_report, validation_rows
from analysis.markdown import markdown_table


def _efficiency(text: str) -> Efficiency:
    """`train=0.3,forward=0.35` over SUITE_H200's figures; a bad key names the ones allowed, a
    bad value the item (`--efficiency train=abc`) and what is allowed."""
    known = {f.name for f in fields(Efficiency)}
    values = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in known:
            raise ValueError(f"--efficiency: unknown key {key!r}; allowed: {', '.join(sorted(known))}")
        try:
            values[key] = float(value)
        except ValueError:
            raise ValueError(f"--efficiency {item}: {key}'s value {value!r} is not a number; give KEY=NUMBER, "
                             "e.g. train=0.3") from None
    try:
        return replace(SUITE_H200, **values)
    except ValueError as error:  # out of its range (Efficiency.__post_init__)
        raise ValueError(f"--efficiency {text}: {error}") from None


def _devices(text: str) -> int:
    """A device count (--trainer-devices, --rollout-devices): a whole number >= 1."""
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; give a whole number of devices >= 1")
    return count


def predict_lines(args: argparse.Namespace) -> list[str]:
    arch, gpu = architecture(args.model), device(args.device)
    try:
        shape = StepShape(prompts=args.prompts, samples=args.samples, prompt_len=args.prompt_len,
                          response_len=args.response_len, response_max=args.response_max,
                          minibatches=args.minibatches, precision=args.precision, checkpointing=args.checkpointing)
    except ValueError as error:  # StepShape names its field; the user gave the flag
        raise ValueError(re.sub(r"StepShape\.(\w+)", lambda m: "--" + m.group(1).replace("_", "-"), str(error))) from None
    flops = gpu.flops(args.precision)
    trainer = Hardware(flops, gpu.bandwidth, args.trainer_devices, link=args.link or float("inf"))
    rollout = Hardware(flops, gpu.bandwidth, args.rollout_devices)
    eff, rows, steps = _efficiency(args.efficiency), [], {}
    for algo in ("recompute", "loglinear"):
        phases = phase_seconds(arch, shape, trainer, rollout, eff, algo)
        side = trainer_side(phases)
        steps[algo] = (serial_step(phases) if args.pipeline == "lagged"
                       else async_step(phases["rollout"], side, phases["weight_sync"], args.bound))
        rows.append([algo, *(f"{phases[p]:.3f}" for p in PHASES), f"{steps[algo]:.3f}",
                     "-" if args.pipeline == "lagged" else bounding_side(phases["rollout"], side, args.bound)])
    speedup = steps["recompute"] / steps["loglinear"]
    return [markdown_table(["algo", *(f"{p} (s)" for p in PHASES), "step (s)", "bounded by"], rows), "",
            f"loglinear over recompute: {speedup:.3f}x, {100 * (1 - 1 / speedup):.1f}% less training time "
            f"({args.pipeline}{'' if args.pipeline == 'lagged' else f', bound {args.bound}'})."]


def paper_lines() -> list[str]:
    rows = []
    for response in (150, 300, 600):
        shape = paper_shape(response)
        for name, eff in (("this suite's trainer on an H200", SUITE_H200), ("implied by AReaL's times",
                                                                              implied_by_areal(shape))):
            p = predictions(eff, shape)
            rows.append([str(response), name, f"{eff.forward:.3f} / {eff.train:.3f}",
                         f"{p['recompute_rollout_s']:.1f}",
                         f"{p['recompute_trainer_s']:.1f} / {p['loglinear_trainer_s']:.1f}",
                         f"{p['async_recompute_s']:.1f} / {p['async_loglinear_s']:.1f}", f"{p['async_speedup']:.2f}x",
                         f"{p['recompute_side']} / {p['loglinear_side']}", f"{p['lagged_speedup']:.2f}x"])
    needs = [[r["source"], r["what"], r["against"], f"{r['speedup']:.2f}x",
              "-" if r["against"] != "recompute" else f"{r['forward_over_train_efficiency']:.2f}"]
             for r in requirements(paper_shape(300))]
    return [markdown_table(["mean response", "efficiencies", "forward / train MFU", "rollout (s)",
                            "trainer: recompute / loglinear (s)", "async step (s)", "async speedup",
                            "bounded by", "lagged speedup"], rows), "",
            markdown_table(["reported by", "figures", "against", "speedup",
                            "forward's efficiency / training's, trainer-bound"], needs)]


def validate_lines(args: argparse.Namespace) -> list[str]:
    fit_reports, arch = [load_report(p) for p in args.fit], architecture(args.model)
    others, eff = [load_report(p) for p in args.benchmarks], fit(fit_reports, arch)
    rows = [[r["shape"] + (" (fit)" if r["fit"] else ""),
             *(f"{r[f'{a}_predicted_s']:.2f} / {r[f'{a}_measured_s']:.2f} ({100 * r[f'{a}_error']:+.1f}%)"
               for a in ("recompute", "loglinear")),
             f"{r['ratio_predicted']:.3f} / {r['ratio_measured']:.3f} "
             f"({r['ratio_predicted'] - r['ratio_measured']:+.3f})"]
            for r in validation_rows(eff, fit_reports, others, arch)]
    return [f"Fitted: the recompute forward at {100 * eff.forward:.0f}% of the measured matmul peak + "
            f"{1000 * eff.forward_pass_s:.0f} ms a micro-batch; the training pass at {100 * eff.train:.0f}% + "
            f"{1000 * eff.train_pass_s:.0f} ms a micro-batch; AdamW at {eff.optimizer:.2f}x the copy's bandwidth; "
            f"{1000 * eff.decode_step_s:.0f} ms fixed a decode step.", "",
            markdown_table(["shape", "recompute step: predicted / measured CPU s (error)", "loglinear step",
                            "recompute / loglinear: predicted / measured"], rows)]


def _shape_name(shape: tuple) -> str:
    prompts, samples, new_tokens, minibatches, _model, precision = shape
    return f"{prompts}x{samples}, r<={new_tokens}, m={minibatches}, {precision}"


def validate_async_lines(args: argparse.Namespace) -> list[str]:
    rows = async_rows(args.runs, args.skip)
    if not rows:
        raise ValueError(f"{', '.join(map(str, args.runs))}: no runtime=async run found")
    table = [[_shape_name(r["shape"]), r["algo"], str(r["bound"]), f"{r['rollout_s']:.2f} / {r['trainer_s']:.2f}",
              f"{r['lagged_step_s']:.2f}", f"{r['measured_s']:.2f}",
              f"{r['from_lagged_s']:.2f} ({100 * r['from_lagged_error']:+.0f}%)",
              f"{r['from_own_s']:.2f} ({100 * r['from_own_error']:+.1f}%)",
              f"{r['rollout_slowdown']:.2f} / {r['trainer_slowdown']:.2f}"] for r in rows]
    by_key = {(r["shape"], r["bound"], r["algo"]): r for r in rows}
    ratios = [[_shape_name(shape), str(bound), f"{r['from_lagged_s'] / l['from_lagged_s']:.3f}",
               f"{r['from_own_s'] / l['from_own_s']:.3f}", f"{r['measured_s'] / l['measured_s']:.3f}"]
              for (shape, bound, algo), r in by_key.items() if algo == "recompute"
              for l in [by_key.get((shape, bound, "loglinear"))] if l]
    lines = [markdown_table(["shape", "algo", "bound", "lagged rollout / trainer (s)", "lagged step (s)",
                             "async step: measured (s)", "predicted from lagged", "predicted from its own phases",
                             "async slowdown: rollout / trainer"], table)]
    if ratios:
        lines += ["", markdown_table(["shape", "bound", "recompute / loglinear: from lagged", "from own phases",
                                      "measured"], ratios)]
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m analysis.cost_model", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("predict", help="each phase, the step and the speedup for one setting")
    for name, kind, default in (("model", str, "qwen2.5-1.5b"), ("device", str, "H800 SXM"), ("prompts", int, 256),
                                ("samples", int, 4), ("prompt-len", int, 120), ("response-len", float, 300.0),
                                ("response-max", int, 1024), ("minibatches", int, 1), ("precision", str, "bf16"),
                                ("trainer-devices", _devices, 4), ("rollout-devices", _devices, 4), ("bound", int, 2),
                                ("link", float, 400e9), ("efficiency", str, "")):
        p.add_argument(f"--{name}", type=kind, default=default)
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--pipeline", choices=("async", "lagged"), default="async")
    sub.add_parser("paper", help="the paper's setting against the reported speedups")
    v = sub.add_parser("validate", help="fit on --fit's benchmark.json files, predict the others")
    v.add_argument("benchmarks", nargs="*", type=Path, help="the shapes to predict")
    v.add_argument("--fit", nargs="+", type=Path, required=True,
                   help="the fit shapes: one, or two that differ only in micro-batches")
    v.add_argument("--model", default="smollm2-135m")
    a = sub.add_parser("validate-async", help="simulate_async against runtime=async runs and their lagged twins")
    a.add_argument("runs", nargs="+", type=Path, help="folders (or log archives) holding the runs")
    a.add_argument("--skip", type=int, default=SKIP, help="steps left out: warm-up and the pipeline filling")
    for q in (p, v, a):
        q.add_argument("--out", type=Path, default=None, help="also write the markdown here")
    sub.choices["paper"].add_argument("--out", type=Path, default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        lines = {"predict": lambda: predict_lines(args), "paper": paper_lines, "validate": lambda: validate_lines(args),
                 "validate-async": lambda: validate_async_lines(args)}[args.command]()
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
