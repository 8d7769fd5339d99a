"""The planner's command line (lesson 21 --params / --model): its flags, the model and assumptions they give,
and the plan printed as a table of the fastest configurations that fit (`common.planning.planner` searches).

    add_planner_args(parser)                       # --params / --model switch lesson 21 to planning
    c, a = planner_inputs(parser.parse_args())     # the GPT shape and the Assumptions (PlanError on bad input)
    report_plan(c, a, top=12, results=None)        # print the assumptions and the top rows; write the JSON
"""

from __future__ import annotations

import time
from dataclasses import replace

from common.harness.ranks import print0
from common.harness.results import Report
from common.planning.assumptions import NAMED, Assumptions, PlanError, describe, shape_for_params
from common.planning.cost_model import GPT
from common.planning.planner import plan

__all__ = [
    "add_planner_args",
    "planner_inputs",
    "format_rows",
    "nothing_fits",
    "report_plan",
    "bytes_table",
]

BYTE_ROWS = ("parameters", "gradients", "ddp_buckets", "optimizer_state", "sent")
COLUMNS = {  # the table's column heads
    "parameters": "params",
    "gradients": "grads",
    "ddp_buckets": "ddp_buckets",
    "optimizer_state": "optimizer",
    "sent": "sent",
    "activations": "activations",
    "activations_checkpointed": "act_ckpt",
}


def nothing_fits(rows: list[dict], a: Assumptions) -> str:
    """The line to print when no configuration fits: the smallest one and what it needs."""
    best = min(rows, key=lambda r: r["memory"]["total"])
    return (
        f"nothing fits: the smallest configuration needs {best['memory']['total'] / 1e9:.1f} GB per GPU (dp "
        f"{best['dp']} tp {best['tp']} pp {best['pp']} cp {best['cp']} ZeRO {best['zero']}), more than "
        f"{a.gpu_memory_gb:g} GB less {a.reserve:.0%}"
    )


def format_rows(rows: list[dict], top: int) -> list[str]:
    head = (
        f"{'dp':>4}{'tp':>3}{'pp':>3}{'cp':>3}{'zero':>5}{'ckpt':>5}  {'params':>7}{'grads':>7}{'optim':>7}"
        f"{'activ':>7}{'total':>7} GB {'dp':>7}{'tp':>7}{'pp':>7}{'cp':>7} GB sent {'step s':>7}{'MFU':>6}"
    )
    out = [head]
    for r in rows[:top]:
        g = {k: v / 1e9 for k, v in r["memory"].items()}
        sent = "".join(f"{r['sent'][k] / 1e9:>7.1f}" for k in ("dp", "tp", "pp", "cp"))
        out.append(
            f"{r['dp']:>4}{r['tp']:>3}{r['pp']:>3}{r['cp']:>3}{r['zero']:>5}{'yes' if r['ckpt'] else 'no':>5}"
            f"  {g['parameters']:>7.1f}{g['gradients']:>7.1f}{g['optimizer_state']:>7.1f}"
            f"{g['activations']:>7.1f}{g['total']:>7.1f}    {sent}         {r['step_s']:>7.2f}"
            f"{r['mfu']:>6.1%}"
        )
    return out


def report_plan(c: GPT, a: Assumptions, top: int, results: str | None, master: bool = True) -> dict:
    """The planner's command line (lesson 21 --params / --model): plan, print the assumptions and the `top`
    fastest configurations that fit, write the JSON (`results`, rank 0 only); PlanError if nothing fits."""
    t = time.perf_counter()
    rows = plan(c, a)
    fit = [r for r in rows if r["fits"]]
    if not fit:
        raise PlanError(nothing_fits(rows, a))
    report = Report(None if master else _NotMaster())
    report.value("assumptions", describe(c, a), "\n".join(describe(c, a)))
    report.value(
        "fitting",
        len(fit),
        "{value} of {rows} configurations fit; the {top} fastest "
        "(GB per GPU; GB each GPU sends per step; estimated step time, MFU):",
        rows=len(rows),
        top=min(top, len(fit)),
    )
    report.record("configurations", fit[:top])
    print0("\n".join(format_rows(fit, top)))
    report.perf("planner_seconds", time.perf_counter() - t, "planned in {value:.2f} s")
    report.write(results)
    return report.results


class _NotMaster:
    master_process = False


def add_planner_args(p) -> None:
    """The planner's flags on the lesson's parser (`--params` or `--model` switches the lesson to planning)."""
    g = p.add_argument_group("planner (no model is built)")
    g.add_argument(
        "--params", type=float, help="plan for a GPT-style model of about this many parameters"
    )
    g.add_argument("--model", choices=sorted(NAMED), help="plan for a named GPT-style shape")
    g.add_argument("--gpus", type=int, default=64, help="GPUs in all (default 64)")
    g.add_argument(
        "--seq",
        type=int,
        default=None,
        help="sequence length (default 4096 with --params, the named shape's with --model)",
    )
    for f in (
        "gpu_memory_gb",
        "gpus_per_node",
        "global_batch",
        "peak_tflops",
        "efficiency",
        "network_gbps",
        "nvlink_gbps",
        "alpha_us",
        "reserve",
        "grad_bytes",
    ):
        default = Assumptions.__dataclass_fields__[f].default
        g.add_argument(
            "--" + f.replace("_", "-"),
            type=type(default),
            default=default,
            help=f"default {default}",
        )
    for f in ("tp", "pp", "cp"):
        g.add_argument(
            f"--{f}", type=int, default=None, help=f"fix the {f} degree (default: search)"
        )
    g.add_argument(
        "--no-flash-attention",
        dest="flash_attention",
        action="store_false",
        help="keep the s x s attention scores for backward (Korthikanti's 5 a s / h term)",
    )
    g.add_argument(
        "--gradient-as-bucket-view",
        action="store_true",
        help="DDP's gradients are views into its buckets (no second copy)",
    )
    g.add_argument("--top", type=int, default=12, help="configurations printed (default 12)")


def planner_inputs(args) -> tuple[GPT, Assumptions]:
    """The model and the assumptions from the lesson's arguments (raises PlanError on bad input)."""
    if args.params is not None and args.model is not None:
        raise PlanError("give --params or --model, not both")
    if (args.seq is not None and args.seq < 1) or args.top < 1:
        raise PlanError("--seq and --top must be positive")
    if args.model:
        c = NAMED[args.model] if args.seq is None else replace(NAMED[args.model], seq=args.seq)
    else:
        c = shape_for_params(args.params, seq=args.seq or 4096)
    fields = {f: getattr(args, f) for f in Assumptions.__dataclass_fields__ if hasattr(args, f)}
    fields["micro_batch"] = args.micro_batch or 1
    return c, Assumptions(**fields)


def bytes_table(rows: dict) -> str:
    """Lesson 21's bytes per rank (predicted or measured), one row per layout, one column per kind of bytes (the union over the rows)."""
    cols = sorted({c for r in rows.values() for c in r}, key=lambda c: (c not in BYTE_ROWS, c))
    head = f"  {'':<8}" + "".join(f"{COLUMNS.get(c, c):>12}" for c in cols)
    lines = [
        f"  {k:<8}" + "".join(f"{r[c]:>12.0f}" if c in r else f"{'-':>12}" for c in cols)
        for k, r in rows.items()
    ]
    return "\n".join([head, *lines])
