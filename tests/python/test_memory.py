"""kernmap's cache of large CPU buffers (ops/memory.cpp): weight gradients of grouped products come from it,
freed blocks are reused for the next equal-size allocation, release returns them, and the settings work. And
advise_huge_pages: large CPU tensors (expert weights) moved onto 2 MiB pages with their contents unchanged, what
kernelize does for the experts it maps."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import kernmap

MiB = 1 << 20


def _weight_grad_case():
    # grad_b: [E, K, N] fp32 = 4 * 1024 * 1024 * 4 bytes = 16 MiB, the cache's threshold; group 2 gets no rows.
    torch.manual_seed(0)
    E, K, N = 4, 1024, 1024
    offs = torch.tensor([3, 7, 7, 12], dtype=torch.int32)
    a = torch.randn(12, K)
    b = torch.randn(E, K, N)
    grad = torch.randn(12, N)
    return grad, a, b, offs


def _expected_grad_b(grad, a, offs):
    out = []
    start = 0
    for end in offs.tolist():
        out.append(a[start:end].double().t() @ grad[start:end].double())
        start = end
    return torch.stack(out)


def test_freed_gradient_is_reused_and_fully_rewritten():
    kernmap.release_cached_memory()
    assert kernmap.cached_memory_bytes() == 0
    grad, a, b, offs = _weight_grad_case()
    _, gb = torch.ops.kernmap.grouped_mm_backward(grad, a, b, offs)
    ptr = gb.data_ptr()
    assert ptr % (2 * MiB) == 0  # a block of the cache: 2 MiB aligned
    gb.fill_(float("nan"))  # stale contents a reuse must overwrite everywhere (the empty group included)
    del gb
    assert kernmap.cached_memory_bytes() == 16 * MiB
    _, gb2 = torch.ops.kernmap.grouped_mm_backward(grad, a, b, offs)
    assert gb2.data_ptr() == ptr
    assert kernmap.cached_memory_bytes() == 0
    torch.testing.assert_close(gb2.double(), _expected_grad_b(grad, a, offs), rtol=1e-4, atol=1e-3)
    assert torch.count_nonzero(gb2[2]) == 0
    del gb2
    assert kernmap.release_cached_memory() == 16 * MiB
    assert kernmap.cached_memory_bytes() == 0
    assert kernmap.release_cached_memory() == 0


def test_small_outputs_do_not_use_the_cache():
    kernmap.release_cached_memory()
    grad, a, b, offs = _weight_grad_case()
    _, gb = torch.ops.kernmap.grouped_mm_backward(grad[:, :512], a, b[:, :, :512], offs)  # 8 MiB
    del gb
    assert kernmap.cached_memory_bytes() == 0


def test_cached_tensor_behaves_like_any_tensor():
    kernmap.release_cached_memory()
    grad, a, b, offs = _weight_grad_case()
    _, gb = torch.ops.kernmap.grouped_mm_backward(grad, a, b, offs)
    expected = gb.clone()
    gb.resize_(5, 1024, 1024)  # the storage grows through the cache's allocator
    torch.testing.assert_close(gb[:4], expected)
    param = torch.nn.Parameter(b.clone())
    param.grad = gb[:4]
    torch.optim.SGD([param], lr=0.1).step()
    torch.testing.assert_close(param.detach(), b - 0.1 * expected)
    del gb, param
    kernmap.release_cached_memory()


def _run(env_extra: dict[str, str], code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


_CHILD = """
import torch, kernmap
from test_memory import _weight_grad_case
grad, a, b, offs = _weight_grad_case()
_, gb = torch.ops.kernmap.grouped_mm_backward(grad, a, b, offs)
del gb
print(kernmap.cached_memory_bytes())
"""


_CHILD_LRU = """
import torch, kernmap
from test_memory import _weight_grad_case
grad, a, b, offs = _weight_grad_case()
# A 32 MiB gradient (fp32 [4, 1024, 2048]) freed first, then the 16 MiB one: under a 40 MiB cap the cache keeps
# the newer block, not the older one (which would make every later 16 MiB allocation fresh memory).
_, g32 = torch.ops.kernmap.grouped_mm_backward(torch.randn(12, 2048), a, torch.randn(4, 1024, 2048), offs)
del g32
print(kernmap.cached_memory_bytes())
_, g16 = torch.ops.kernmap.grouped_mm_backward(grad, a, b, offs)
p16 = g16.data_ptr()
del g16
print(kernmap.cached_memory_bytes())
_, again = torch.ops.kernmap.grouped_mm_backward(grad, a, b, offs)
print(int(again.data_ptr() == p16))
"""


def test_cache_gives_back_the_least_recently_freed_block_at_the_cap():
    here = os.path.dirname(__file__)
    r = _run({"KERNMAP_LARGE_CACHE_MB": "40", "PYTHONPATH": here + os.pathsep + os.environ.get("PYTHONPATH", "")},
             _CHILD_LRU)
    assert r.returncode == 0, r.stderr
    assert [int(x) for x in r.stdout.split()[-3:]] == [32 * MiB, 16 * MiB, 1]


@pytest.mark.parametrize(("value", "cached"), [("0", 0), ("8", 0), ("64", 16 * MiB)])
def test_cache_cap_setting(value, cached):
    here = os.path.dirname(__file__)
    r = _run({"KERNMAP_LARGE_CACHE_MB": value, "PYTHONPATH": here + os.pathsep + os.environ.get("PYTHONPATH", "")},
             _CHILD)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout.strip().splitlines()[-1]) == cached


def test_bad_cache_setting_is_a_clear_error():
    here = os.path.dirname(__file__)
    r = _run({"KERNMAP_LARGE_CACHE_MB": "lots", "PYTHONPATH": here + os.pathsep + os.environ.get("PYTHONPATH", "")},
             _CHILD)
    assert r.returncode != 0
    assert "KERNMAP_LARGE_CACHE_MB must be a whole number of MiB, got 'lots'" in r.stderr


def _huge_kib_at(address: int) -> int:
    """AnonHugePages (KiB) of this process's mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    return 0


def _collapse_supported() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                return False
    except OSError:
        return False
    major, minor = (int(x) for x in os.uname().release.split("-")[0].split(".")[:2])
    return (major, minor) >= (6, 1)


def test_advise_huge_pages_keeps_contents_and_backs_the_tensor_with_huge_pages():
    torch.manual_seed(0)
    t = torch.randn(24 * MiB // 4)  # 24 MiB: at least one whole 2 MiB page inside, wherever it starts
    before = t.clone()
    done = kernmap.advise_huge_pages(t) or kernmap.advise_huge_pages(t)  # twice is harmless
    assert isinstance(done, bool)
    assert torch.equal(t, before)
    if not _collapse_supported():
        pytest.skip("no transparent huge pages or MADV_COLLAPSE (Linux < 6.1) here")
    assert done
    assert _huge_kib_at(t.data_ptr() + 4 * MiB) >= 2048
    t.mul_(2)  # an ordinary tensor afterwards
    assert torch.equal(t, before * 2)


@pytest.mark.parametrize("make", [lambda: torch.randn(1000),  # below 16 MiB: nothing to gain
                                  lambda: torch.empty(8 * MiB, device="meta"),  # no memory
                                  lambda: torch.randn(5 * MiB)[::1000]],  # a view: advises its storage
                         ids=["small", "meta", "view_of_large"])
def test_advise_huge_pages_only_acts_on_large_cpu_storage(make):
    t = make()
    before = t.clone()
    done = kernmap.advise_huge_pages(t)
    if t.device.type == "meta" or t.untyped_storage().nbytes() < 16 * MiB:
        assert done is False
    else:
        assert torch.equal(t, before)


def test_huge_pages_setting_turns_the_advice_off():
    code = "import torch, kernmap; print(kernmap.advise_huge_pages(torch.randn(8 << 20)))"
    r = _run({"KERNMAP_HUGE_PAGES": "0"}, code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "False"


def test_kernelize_advises_the_weights_of_the_experts_it_maps():
    from hf_models import make_model
    model = make_model("qwen3_moe")
    kernmap.kernelize(model, mode="training", device="cpu")
    experts = [m for m in model.modules() if hasattr(m, "gate_up_proj")]
    assert experts and all(m.__dict__.get("_kernmap_weights_advised") for m in experts)
