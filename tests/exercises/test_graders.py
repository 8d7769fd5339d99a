"""Every grader proved three ways: it passes the reference solution, fails the untouched stub, and fails a
plausible wrong answer (tests/exercises/wrong_answers/NAME.py, and NAME__what.py for mistakes a grader once
passed) with a message that points at the mistake. Right answers other than the reference
(tests/exercises/right_answers/NAME__what.py, a design the contract allows) must pass.

And no check of a grader goes untested: every statement of a grader that hands back a problem (a `return
[...]`, a `problems.append(...)`, a hint's `return "..."`) must be reached by some wrong answer, so that a
check deleted from a grader lets its wrong answer pass, and this test fails.

The reference and the answers are graded in one launch of the exercise's ranks (NAME.py last, so a wrong
answer that kills its process, or leaves its peers waiting, cannot take the others' results with it)."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest

from exercises import EXERCISES
from exercises._grading import grade, grade_many, module_for

pytestmark = pytest.mark.slow  # most graders start 2-4 gloo processes

HERE = Path(__file__).parent

# What each wrong answer's first problem must say: the grader names the mistake, not only that there is one.
WRONG_SAYS = {
    "ring_allreduce": "rank + 1",
    "ddp_by_hand": "async_op=True",
    "distributed_sampler": "pad the order",
    "exact_evaluation": "that is the mean of the ranks' accuracies",
    "sync_bn_stats": "rank 2 skipped a collective",
    "accumulation": "the sum of the 4 micro-batches' mean losses",
    "one_f_one_b": "1F1B holds",
    "tensor_parallel_mlp": "f's backward must all-reduce",
    "zero1_optimizer": "broadcast each parameter",
    "reshard_plan": "not rows // W",
    "training_state": "copy the state_dicts",
    "compress_hook": "Divide by the world size before the all-reduce",
    "ring_attention_merge": "you averaged the two outputs",
    "moe_dispatch": "e // (E/ep)",
    "predict_memory": "ZeRO-1 shards only the optimizer state",
    "hsdp_wrapping": "HSDP needs a 2-D mesh",
    "tp_decode_step": "all-reduce (sum) the partial outputs",
    "library_lines": "only accelerator.backward divides by k",
}

# More wrong answers (tests/exercises/wrong_answers/NAME__what.py), each a mistake a grader once passed or a
# check no other wrong answer reaches, and what its problems must say. They are graded in the same launch,
# before NAME.py (which may kill its processes).
MORE_WRONG_SAYS = {
    "hsdp_wrapping": {
        "root_only": "fully_shard each block",
        "sync_off": "leave gradient sync on",
        "swapped_dims": "the replicate dim first",
        "fixed_2x2": "not a fixed 2 x 2",
    },
    "ring_allreduce": {
        "alias": "dist.all_reduce called",
        "all_gather_object": "dist.all_gather_object called",
        "whole_tensor": "not the whole tensor",
        "minimal_schedule": "the minimal script's schedule",
        "whole_result": "return only the sum of chunk r",
        "minimal_all_gather": "the all-gather sends it on first",
        "unchanged": "its tensor is unchanged",
        "one_step_short": "did every rank send to rank + 1",
        "all_reduce_whole_tensor": "a ring all-reduce sends 2(n-1)/n",
    },
    "ddp_by_hand": {
        "reduced_twice": "each gradient all-reduced once",
        "half": "never by a fixed number",
        "wait_in_hook": "waited on each all-reduce before the next gradient hook",
        "never_waited": "never waited on",
        "frozen_in_bucket": "holds a frozen parameter",
        "forward_order": "forward order",
        "at_most": "the bucket rule is the difference",
        "summed": "the all-reduce sums",
        "no_broadcast": "broadcast every parameter and buffer",
        "frozen_not_broadcast": "frozen parameters (mid.weight, mid.bias)",
        "buffers_not_broadcast": "buffers (scale)",
        "wraps_frozen_model": "raise RuntimeError",
        "after_backward": "started after backward had finished",
        "stale_bucket": "the first step's gradients matched",
        "not_copied_back": "write the average (sum / world size) of each gradient",
    },
    "distributed_sampler": {
        "cached_order": "order of the epoch before",
        "global_rng": "changed torch's global random state",
        "ignores_drop_last": "every rank must yield",
        "sorted_slice": "the right indices in another order",
        "contiguous_slice": "order[r::num_replicas]",
        "len_dataset": "len is what THIS rank yields",
    },
    "exact_evaluation": {
        "per_class_means": "mean of the ranks' accuracies on class 1",
        "local": "correct / total over all ranks",
        "local_per_class": "the fraction predicted 1",
        "no_class_list": "expected num_classes = 3",
    },
    "sync_bn_stats": {
        "averaged": "reduce sums and counts",
        "unstable": "cancels in float32",
        "mean_of_variances": "the spread between the ranks' means",
    },
    "library_lines": {
        "no_set_epoch": "the order of epoch 0 again",
        "no_sampler": "use DistributedSampler",
        "no_no_sync": "inside ddp_model.no_sync()",
        "no_zero_grad": "zero_grad every k micro-batches",
    },
    "accumulation": {
        "divided_by_k": "right only when the micro-batches are equal",
        "no_no_sync": "inside ddp_model.no_sync()",
        "no_zero_grad": "zero_grad once",
    },
    "tensor_parallel_mlp": {
        "bias_twice": "then add b2 once",
        "bias_split": "the gradient of b2",
    },
    "zero1_optimizer": {
        "full_beside_local": "[166, 166, 166]",
        "two_ranks": "not a fixed number",
        "local_over_all": "this rank's shard only",
        "never_waited": "never waited on",
        "empty_shard": "takes an empty group",
        "no_param_groups": "parameter groups",
        "groups_merged": "each parameter group's options",
        "round_robin_two": "holds no shard",
        "no_local": "self.local",
    },
    "reshard_plan": {
        "local_rows": "rows are global",
        "empty_pieces": "has an empty piece",
        "whole_files": "holds rows",
        "not_a_list": "return a list",
        "past_the_file": "only",
    },
    "training_state": {
        "no_param_groups": "param_groups hold the lr",
        "step_after": "restore returned step 4",
        "no_torch_rng": "torch.get_rng_state() for dropout",
    },
    "compress_hook": {
        "summed": "that is the sum of the ranks' gradients",
        "fp32": "expected float16: cast the bucket's buffer",
        "always_fp16": "expected bfloat16",
        "divide_in_fp32": "expected 0 (bit for bit)",
        "local": "never called dist.all_reduce",
    },
    "ring_attention_merge": {
        "exp_lse": "exp(lse) overflows",
        "float32": "float32's rounding",
        "exp_difference": "exp of that difference",
        "max_lse": "lse = logaddexp",
    },
    "moe_dispatch": {
        "float_counts": "send_counts is torch.float32",
        "float_order": "order is torch.float32",
        "counts_per_expert": "one entry per expert",
        "no_minlength": "bincount's minlength",
        "distinct_experts": "must count the rows",
        "sorted_values": "must be a permutation",
        "round_robin_order": "grouped by destination rank",
        "by_rank_only": "sort the rows by expert",
        "ties_reversed": "a stable sort",
    },
    "predict_memory": {
        "one_flat_buffer": "padded as ONE flat buffer",
        "step_per_parameter": "4-byte fp32 `step`",
        "one_moment": "exp_avg, exp_avg_sq",
        "stage2_params_sharded": "stages 1-2 keep the whole flat buffer",
        "stage3_unpadded": "pad each unit",
        "tuple": "return a dict",
    },
    "tp_decode_step": {
        "no_cache_write": "is not this token's k",
        "fill_rest": "changed at positions other than pos",
        "whole_cache": "attend to positions 0..pos only",
    },
}

# Right answers other than the reference (tests/exercises/right_answers/NAME__what.py): designs the contract
# allows, which the grader must pass.
RIGHT_ANSWERS: dict[str, list[str]] = {"zero1_optimizer": ["flat_shards"]}

# Problem statements of a grader that no wrong answer reaches yet (a substring of the statement's first
# line). Keep this empty: add a wrong answer instead.
UNREACHED: dict[str, list[str]] = {
    # resumed losses equal at every step imply equal parameters before the last update, and that update
    # then uses the same gradient and optimizer state: a safety net no single wrong answer gets past
    "training_state": ["after resuming, parameter"],
}


def problem_sites(path: Path) -> dict[range, str]:
    """{lines: first line's source} of every statement in a grader that hands back a problem: `return [...]`
    of a non-empty list, `problems.append(...)`, and a helper's `return "..."` or `return f"..."` (a hint)."""
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines()
    sites = {}
    for node in ast.walk(ast.parse(source)):
        value = getattr(node, "value", None)
        returns_problem = isinstance(node, ast.Return) and (
            (isinstance(value, ast.List) and value.elts)
            or isinstance(value, ast.JoinedStr)
            or (isinstance(value, ast.Constant) and isinstance(value.value, str) and value.value)
        )
        appends_problem = (
            isinstance(node, ast.Expr)
            and isinstance(value, ast.Call)
            and isinstance(value.func, ast.Attribute)
            and value.func.attr == "append"
            and isinstance(value.func.value, ast.Name)
            and value.func.value.id == "problems"
        )
        if returns_problem or appends_problem:
            sites[range(node.lineno, node.end_lineno + 1)] = lines[node.lineno - 1].strip()
    return sites


class LinesRun:
    """The lines of one file that run inside the block, in this process (the graders' judge and check run
    here; their on_rank runs in the ranks)."""

    def __init__(self, path: Path):
        self.path, self.lines = str(path), set()

    def _local(self, frame, event, arg):
        if event == "line":
            self.lines.add(frame.f_lineno)
        return self._local

    def _global(self, frame, event, arg):
        return self._local if frame.f_code.co_filename == self.path else None

    def __enter__(self):
        self._previous = sys.gettrace()
        sys.settrace(self._global)
        return self

    def __exit__(self, *exc):
        sys.settrace(self._previous)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(EXERCISES))
def test_grader_passes_the_reference_and_fails_a_wrong_answer(name):
    reference, wrong = module_for(name, reference=True), f"tests.exercises.wrong_answers.{name}"
    right = [
        f"tests.exercises.right_answers.{name}__{what}" for what in RIGHT_ANSWERS.get(name, [])
    ]
    says = {f"{wrong}__{what}": text for what, text in MORE_WRONG_SAYS.get(name, {}).items()}
    says[wrong] = WRONG_SAYS[name]
    grader_file = Path(importlib.import_module(f"exercises.graders.{name}").__file__)
    with LinesRun(grader_file) as run:
        problems = grade_many(name, [reference, *right, *says])
    for module in (reference, *right):
        assert problems[module] == [], (module, problems[module])
    for module, text in says.items():
        assert problems[module], f"the grader of {name} passed a wrong answer: {module}"
        assert text in " ".join(problems[module]), (module, problems[module])
    known = UNREACHED.get(name, [])
    unreached = {
        lines.start: code
        for lines, code in problem_sites(grader_file).items()
        if run.lines.isdisjoint(lines) and not any(k in code for k in known)
    }
    assert not unreached, (
        f"checks of exercises/graders/{name}.py that no wrong answer reaches (add one to "
        f"tests/exercises/wrong_answers/): {unreached}"
    )


@pytest.mark.parametrize("name", list(EXERCISES))
def test_grader_fails_the_untouched_stub(name):
    problems = grade(name, module_for(name))
    assert len(problems) == 1 and problems[0].startswith("not solved yet:"), problems


def test_every_exercise_has_a_stub_a_solution_a_grader_and_a_wrong_answer():
    for name in EXERCISES:
        for module in (
            f"exercises.{name}",
            f"exercises.solutions.{name}",
            f"exercises.graders.{name}",
            f"tests.exercises.wrong_answers.{name}",
        ):
            importlib.import_module(module)


def test_every_answer_file_is_graded():
    """A wrong (or right) answer left out of the tables above would test nothing."""
    listed = {f"{name}__{what}" for name, more in MORE_WRONG_SAYS.items() for what in more} | set(
        WRONG_SAYS
    )
    files = {p.stem for p in (HERE / "wrong_answers").glob("*.py") if p.stem != "__init__"}
    assert files == listed, (sorted(files - listed), sorted(listed - files))
    listed_right = {f"{name}__{what}" for name, whats in RIGHT_ANSWERS.items() for what in whats}
    files_right = {p.stem for p in (HERE / "right_answers").glob("*.py") if p.stem != "__init__"}
    assert files_right == listed_right, (
        sorted(files_right - listed_right),
        sorted(listed_right - files_right),
    )


def test_problem_sites_finds_each_kind_of_check(tmp_path):
    grader = tmp_path / "g.py"
    grader.write_text(
        'def judge(a):\n    problems = []\n    if a:\n        return [f"x {a}"]\n'
        '    problems.append("y")\n    return []\n\n\ndef hint():\n    return "z"\n'
    )
    assert sorted(lines.start for lines in problem_sites(grader)) == [4, 5, 10]
