"""The pytest plugin: world tests run on every rank, fail with the rank's traceback, GPU skips."""

from __future__ import annotations

import pytest

from shardopt.testing import cuda_device_count

# Inner sessions run like the project's: --import-mode=importlib, in which the ranks cannot
# import the test file by name.
# hypothesis's plugin costs seconds per inner session and is not needed there.
IMPORTLIB = ("-p", "no:cacheprovider", "-p", "no:hypothesispytest", "--import-mode=importlib")

RANKS_MEET = """
import pytest
import torch
import torch.distributed as dist


@pytest.mark.world(2)
def test_every_rank_runs_the_body(world, tmp_path):
    (tmp_path / f"rank{world.rank}").write_text(str(world.world_size))
    total = torch.tensor([world.rank + 1.0], device=world.device)
    dist.all_reduce(total, group=world.process_group)
    dist.barrier()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]
    assert total.item() == 3.0
"""

PARAMETRIZED = """
import pytest
import torch.distributed as dist


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.world("n")
def test_world_size_follows_the_parameter(world, n):
    assert world.world_size == n == dist.get_world_size()


class TestInAClass:
    @pytest.mark.parametrize("n", [2])
    @pytest.mark.world("n")
    def test_methods_run_on_every_rank_too(self, world, n):
        assert dist.get_rank() == world.rank < n
"""

FAILING_RANK = """
import pytest


@pytest.mark.world(3)
def test_rank_one_is_wrong(world):
    unexpected = 7
    assert world.rank * 7 != unexpected
"""


@pytest.mark.parametrize(
    "mode", [IMPORTLIB, ("-p", "no:cacheprovider")], ids=["importlib", "prepend"]
)
def test_world_test_body_runs_on_every_rank(
    pytester: pytest.Pytester, mode: tuple[str, ...]
) -> None:
    pytester.makepyfile(test_meet=RANKS_MEET)
    pytester.runpytest(*mode).assert_outcomes(passed=1)


def test_world_size_can_come_from_a_parameter_in_functions_and_classes(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_sizes=PARAMETRIZED)
    pytester.runpytest(*IMPORTLIB).assert_outcomes(passed=5)


def test_failing_rank_fails_the_test_with_its_rewritten_assert(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_failing=FAILING_RANK)
    result = pytester.runpytest(*IMPORTLIB)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*spawn: rank 1 of 3 raised AssertionError: assert (1 * 7) != 7*",
            "*where 1 = World(rank=1, world_size=3, backend='gloo', device='cpu').rank*",
            "*---- rank 1 traceback ----*",
            "*assert world.rank * 7 != unexpected*",
        ]
    )


def test_failing_rank_output_is_shown_with_the_failure(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_noisy="""
        import pytest

        @pytest.mark.world(2)
        def test_noisy(world):
            print(f"rank {world.rank} was here")
            assert world.rank == 0
        """
    )
    result = pytester.runpytest(*IMPORTLIB)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*[[]rank 1[]] rank 1 was here*"])


def test_warnings_are_errors_in_the_ranks_when_they_are_in_the_test(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        test_warns="""
        import warnings
        import pytest

        @pytest.mark.world(2)
        def test_warns(world):
            warnings.warn("rank warning", UserWarning)
        """
    )
    result = pytester.runpytest(*IMPORTLIB, "-W", "error::UserWarning")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*raised UserWarning: rank warning*"])


def test_skip_in_a_rank_skips_the_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_skips="""
        import pytest

        @pytest.mark.world(2)
        def test_skips(world):
            if world.rank == 1:
                pytest.skip("not on rank 1")
        """
    )
    result = pytester.runpytest(*IMPORTLIB, "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*not on rank 1*"])


@pytest.mark.skipif(cuda_device_count() >= 8, reason="this machine has 8 CUDA devices")
def test_gpu_marker_skips_with_the_count_found(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_gpu="""
        import pytest

        @pytest.mark.gpu(8)
        def test_needs_eight():
            raise AssertionError("must not run")
        """
    )
    result = pytester.runpytest(*IMPORTLIB, "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines([f"*needs 8 CUDA device(s), found {cuda_device_count()}*"])


@pytest.mark.skipif(cuda_device_count() >= 2, reason="this machine has 2 CUDA devices")
def test_nccl_world_skips_without_a_gpu_per_rank(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_nccl="""
        import pytest

        @pytest.mark.world(2, backend="nccl")
        def test_nccl(world):
            raise AssertionError("must not run")
        """
    )
    result = pytester.runpytest(*IMPORTLIB, "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*world(2, backend='nccl') needs 2 CUDA device(s) with NCCL*"])


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (
            "def test_x(world):\n    pass\n",
            "*the world fixture needs @pytest.mark.world(n) on the test*",
        ),
        (
            "import pytest\n\n@pytest.mark.world(0)\ndef test_x(world):\n    pass\n",
            "*world marker: expected a world size int >= 1, got 0*",
        ),
        (
            "import pytest\n\n@pytest.mark.world('n')\ndef test_x(world):\n    pass\n",
            "*has no parameter 'n' to take the world size from*",
        ),
        (
            "import pytest\n\n@pytest.mark.world(2, backend='mpi')\ndef test_x(world):\n    pass\n",
            "*world marker: expected backend in ('auto', 'gloo', 'nccl'), got 'mpi'*",
        ),
        (
            "import pytest\n\n@pytest.fixture\ndef fn():\n    return lambda: 1\n\n"
            "@pytest.mark.world(2)\ndef test_x(world, fn):\n    pass\n",
            "*the value of 'fn' cannot be sent to the ranks of a world test*",
        ),
    ],
    ids=["fixture-without-marker", "size-0", "missing-parameter", "bad-backend", "unpicklable"],
)
def test_misuse_is_reported_with_the_rule(
    pytester: pytest.Pytester, source: str, message: str
) -> None:
    pytester.makepyfile(test_misuse=source)
    result = pytester.runpytest(*IMPORTLIB)
    assert result.ret != 0
    result.stdout.fnmatch_lines([message])


KILLS_THEN_PASSES = """
import os

import pytest
import torch
import torch.distributed as dist


@pytest.mark.world(2, backend="gloo", timeout=30)
def test_a_passes(world):
    with open(f"pid{world.rank}", "w") as file:
        file.write(str(os.getpid()))


@pytest.mark.world(2, backend="gloo", timeout=30)
def test_b_passes_on_the_same_ranks(world):
    with open(f"pid{world.rank}") as file:
        assert file.read() == str(os.getpid())


@pytest.mark.world(2, backend="gloo", timeout=30)
def test_c_kills_rank_one(world):
    if world.rank == 1:
        os._exit(9)
    dist.barrier()


@pytest.mark.world(2, backend="gloo", timeout=30)
def test_d_passes_on_new_ranks(world):
    with open(f"pid{world.rank}") as file:
        assert file.read() != str(os.getpid())
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2
"""


def test_a_test_that_kills_a_warm_rank_fails_alone_and_the_next_passes_on_a_fresh_pool(
    pytester: pytest.Pytester,
) -> None:
    """Warm ranks ([Note: warm worlds]) serve the tests of a session in turn; a test that kills
    one fails with a fresh world's error, and the next test passes on new ranks."""
    pytester.makepyfile(test_kills=KILLS_THEN_PASSES)
    result = pytester.runpytest_subprocess(*IMPORTLIB, "-p", "no:randomly")
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(["spawn: rank 1 of 2 exited with code 9 before returning*"])
    result.stdout.fnmatch_lines(["FAILED test_kills.py::test_c_kills_rank_one*"])
