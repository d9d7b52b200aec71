"""kernmap.use_mapping scopes belong to a context, as a contextvars.ContextVar's value does: asyncio tasks on one
thread and other threads never see each other's scopes, a task created inside a block inherits it, and leaving a
scope from a context that did not enter it is an error that leaves the scope where it was."""

import asyncio
import contextvars
import threading

import pytest
import torch

import kernmap

A = kernmap.register_kernel(kernmap.Kernel(name="test/scope_a", layer="RMSNorm", fn=torch.ops.kernmap.reference_rms_norm,
                                           has_backward=True))
B = kernmap.register_kernel(kernmap.Kernel(name="test/scope_b", layer="RMSNorm", fn=torch.ops.kernmap.reference_rms_norm,
                                           has_backward=True))


def kernel() -> str:
    return kernmap.resolve("RMSNorm", "cpu", "training").kernel


def scoped(name: str):
    return kernmap.use_mapping({"RMSNorm": {"cpu": name}})


def test_two_asyncio_tasks_on_one_thread_see_only_their_own_scope():
    seen = {}

    async def task(name, mine, other):
        with scoped(name):
            mine.set()
            await other.wait()  # the other task is inside its own scope now
            seen[name] = (kernel(), kernmap.effective_mapping()["RMSNorm"]["cpu"])
            await asyncio.sleep(0)
        seen[name + " after"] = kernel()

    async def outside(a_in, b_in):
        await a_in.wait()
        await b_in.wait()
        seen["outside"] = kernel()

    async def main():
        a_in, b_in = asyncio.Event(), asyncio.Event()
        await asyncio.gather(task("test/scope_a", a_in, b_in), task("test/scope_b", b_in, a_in), outside(a_in, b_in))

    asyncio.run(main())
    assert seen["test/scope_a"] == ("test/scope_a", {"fallback": "test/scope_a"})
    assert seen["test/scope_b"] == ("test/scope_b", {"fallback": "test/scope_b"})
    assert seen["outside"] == "kernmap/rms_norm"
    assert seen["test/scope_a after"] == seen["test/scope_b after"] == "kernmap/rms_norm"


def test_a_task_created_inside_a_block_inherits_the_scope_and_its_own_scopes_stay_its_own():
    async def child():
        inherited = kernel()
        with scoped("test/scope_b"):
            await asyncio.sleep(0)
            return inherited, kernel()

    async def main():
        with scoped("test/scope_a"):
            task = asyncio.create_task(child())
            await asyncio.sleep(0)  # the child is inside its scope now
            here = kernel()
            return here, await task

    here, (inherited, inner) = asyncio.run(main())
    assert (here, inherited, inner) == ("test/scope_a", "test/scope_a", "test/scope_b")
    assert kernel() == "kernmap/rms_norm"


def test_threads_do_not_see_each_others_scopes_and_kernelize_follows_the_context():
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    barrier = threading.Barrier(2)
    seen = {}

    def worker(name):
        with scoped(name):
            barrier.wait()  # both threads inside their scopes
            seen[name] = kernmap.kernelize(Qwen2RMSNorm(8), mode="training", device="cpu").rows[0].kernel
            barrier.wait()

    threads = [threading.Thread(target=worker, args=(n,)) for n in ("test/scope_a", "test/scope_b")]
    with scoped("kernmap/rms_norm"):
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert kernel() == "kernmap/rms_norm"
    assert seen == {"test/scope_a": "test/scope_a", "test/scope_b": "test/scope_b"}


def test_leaving_a_scope_from_another_thread_is_an_error_and_the_scope_stays_where_it_was_entered():
    scope = scoped("test/scope_a")
    scope.__enter__()
    errors = []

    def leave():
        try:
            scope.__exit__(None, None, None)
        except kernmap.KernmapError as e:
            errors.append(str(e))

    thread = threading.Thread(target=leave)
    thread.start()
    thread.join()
    assert len(errors) == 1 and "entered in another context (another thread or asyncio task)" in errors[0]
    assert kernel() == "test/scope_a"  # still active here
    scope.__exit__(None, None, None)  # the entering context leaves it
    assert kernel() == "kernmap/rms_norm"


def test_leaving_a_scope_from_another_task_is_an_error():
    async def main():
        scope = scoped("test/scope_a")

        async def enter():
            scope.__enter__()

        async def leave():
            scope.__exit__(None, None, None)

        await asyncio.create_task(enter())
        with pytest.raises(kernmap.KernmapError, match="entered in another context"):
            await asyncio.create_task(leave())
        with pytest.raises(kernmap.KernmapError, match="entered in another context"):
            contextvars.copy_context().run(scope.__exit__, None, None, None)
        return kernel()

    assert asyncio.run(main()) == "kernmap/rms_norm"  # the entering task's scope ended with it


def test_scopes_end_out_of_nesting_order_and_are_entered_once():
    outer, inner = scoped("test/scope_a"), scoped("test/scope_b")
    outer.__enter__()
    inner.__enter__()
    outer.__exit__(None, None, None)
    assert kernel() == "test/scope_b"
    inner.__exit__(None, None, None)
    assert kernel() == "kernmap/rms_norm"
    with pytest.raises(kernmap.KernmapError, match="never entered"):
        inner.__exit__(None, None, None)
    with outer, pytest.raises(kernmap.KernmapError, match="entered already"):
        outer.__enter__()
    assert kernel() == "kernmap/rms_norm"


def test_a_bad_scope_fails_when_the_block_starts():
    with pytest.raises(kernmap.KernmapError, match="is not registered"):
        with scoped("nobody/rms_norm"):
            pass
    assert kernel() == "kernmap/rms_norm"
