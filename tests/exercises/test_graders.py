"""Every grader proved three ways: it passes the reference solution, fails the untouched stub, and fails a
plausible wrong answer (tests/exercises/wrong_answers/NAME.py, and NAME__what.py for mistakes a grader once
passed) with a message that points at the mistake.

The reference and the wrong answers are graded in one launch of the exercise's ranks (NAME.py last, so a wrong
answer that kills its process cannot take the others' results with it)."""
from __future__ import annotations

import pytest

from exercises import EXERCISES
from exercises._grading import grade, grade_many, module_for

pytestmark = pytest.mark.slow  # most graders start 2-4 gloo processes

# What each wrong answer's first problem must say: the grader names the mistake, not only that there is one.
WRONG_SAYS = {
    "ring_allreduce": "rank + 1",
    "ddp_by_hand": "async_op=True",
    "distributed_sampler": "pad the order",
    "exact_evaluation": "expected 0.5556",
    "sync_bn_stats": "reduce sums and counts",
    "accumulation": "differ from one step on the global batch",
    "one_f_one_b": "1F1B holds",
    "tensor_parallel_mlp": "f's backward must all-reduce",
    "zero1_optimizer": "broadcast each parameter",
    "training_state": "copy the state_dicts",
    "ring_attention_merge": "you averaged the two outputs",
    "moe_dispatch": "e // (E/ep)",
    "predict_memory": "ZeRO-1 shards only the optimizer state",
}

# More wrong answers (tests/exercises/wrong_answers/NAME__what.py), each a mistake a grader once passed, and
# what its problems must say. They are graded in the same launch, before NAME.py (which may kill its
# processes).
MORE_WRONG_SAYS = {
    "ring_allreduce": {"alias": "dist.all_reduce called",
                       "all_gather_object": "dist.all_gather_object called",
                       "whole_tensor": "not the whole tensor"},
    "ddp_by_hand": {"reduced_twice": "each gradient all-reduced once", "half": "never by a fixed number",
                    "wait_in_hook": "waited on each all-reduce before the next gradient hook"},
    "zero1_optimizer": {"full_beside_local": "[166, 166, 166]", "two_ranks": "not a fixed number",
                        "local_over_all": "this rank's shard only"},
    "training_state": {"no_param_groups": "param_groups hold the lr"},
    "distributed_sampler": {"cached_order": "order of the epoch before",
                            "global_rng": "changed torch's global random state"},
    "ring_attention_merge": {"exp_lse": "exp(lse) overflows", "float32": "float32's rounding"},
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(EXERCISES))
def test_grader_passes_the_reference_and_fails_a_wrong_answer(name):
    reference, wrong = module_for(name, reference=True), f"tests.exercises.wrong_answers.{name}"
    says = {f"{wrong}__{what}": text for what, text in MORE_WRONG_SAYS.get(name, {}).items()}
    says[wrong] = WRONG_SAYS[name]
    problems = grade_many(name, [reference, *says])
    assert problems[reference] == [], problems[reference]
    for module, text in says.items():
        assert problems[module], f"the grader of {name} passed a wrong answer: {module}"
        assert text in " ".join(problems[module]), (module, problems[module])


@pytest.mark.parametrize("name", list(EXERCISES))
def test_grader_fails_the_untouched_stub(name):
    problems = grade(name, module_for(name))
    assert len(problems) == 1 and problems[0].startswith("not solved yet:"), problems


def test_every_exercise_has_a_stub_a_solution_a_grader_and_a_wrong_answer():
    import importlib
    for name in EXERCISES:
        for module in (f"exercises.{name}", f"exercises.solutions.{name}", f"exercises.graders.{name}",
                       f"tests.exercises.wrong_answers.{name}"):
            importlib.import_module(module)
