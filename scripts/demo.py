"""Show each installed op package working: a tiny call of every op, checked
against plain PyTorch, forward and backward, on the CPU and (where the build
and the machine have one) on the GPU.

    python scripts/demo.py [IMPORT_NAME ...]     (default: every op package in packages/)

An op package without a demo here still gets its registered operators and
their schemas printed, so a new package shows up before it has a demo.
Exit status 1 when any demo fails.
"""

from __future__ import annotations

import importlib
import sys
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def fmt(t: torch.Tensor) -> str:
    return "[" + ", ".join(f"{v:g}" for v in t.detach().flatten().tolist()) + "]"


def _devices(mod) -> list[str]:
    build = getattr(getattr(mod, "_runtime", None), "BUILD_INFO", {})
    return ["cpu"] + (["cuda"] if build.get("cuda") and torch.cuda.is_available() else [])


def demo_round_op(mod, device: str) -> None:
    x = torch.tensor([-1.5, -0.4, 0.2, 0.5, 0.7, 2.5], device=device, requires_grad=True)
    y = mod.round_ste(x)
    y.sum().backward()
    print(f"  round_ste({fmt(x)}) = {fmt(y)}")
    print(f"  gradient passes straight through: {fmt(x.grad)}")
    assert y.tolist() == torch.floor(x.detach() + 0.5).tolist()
    assert x.grad.tolist() == [1.0] * 6


def demo_vecadd_op(mod, device: str) -> None:
    a = torch.arange(5.0, device=device, requires_grad=True)
    b = torch.full((5,), 10.0, device=device, requires_grad=True)
    c = mod.add(a, b)
    c.sum().backward()
    print(f"  add({fmt(a)}, {fmt(b)}) = {fmt(c)}")
    assert torch.equal(c, a.detach() + b.detach())
    assert a.grad.tolist() == b.grad.tolist() == [1.0] * 5


def demo_lltm_op(mod, device: str) -> None:
    torch.manual_seed(0)
    batch, features, state = 4, 8, 16
    cell = mod.LLTM(features, state, device=device, dtype=torch.float64)
    x = torch.randn(batch, features, device=device, dtype=torch.float64)
    h = torch.zeros(batch, state, device=device, dtype=torch.float64)
    c = torch.zeros(batch, state, device=device, dtype=torch.float64)
    for _ in range(3):
        h, c = cell(x, (h, c))
    (h.sum() + c.sum()).backward()
    ref_h, ref_c = mod.lltm_reference(x, cell.weights, cell.bias, torch.zeros_like(h), torch.zeros_like(c))
    new_h, new_c = cell(x, (torch.zeros_like(h), torch.zeros_like(c)))
    print(
        f"  {cell}: 3 steps on a [{batch}, {features}] input, h[0, :4] = "
        f"{fmt(h[0, :4].round(decimals=4))}, |dW| = {cell.weights.grad.norm():.4f}"
    )
    torch.testing.assert_close(new_h, ref_h)
    torch.testing.assert_close(new_c, ref_c)
    print("  one step matches the pure-PyTorch reference")


DEMOS = {"round_op": demo_round_op, "vecadd_op": demo_vecadd_op, "lltm_op": demo_lltm_op}


def op_packages() -> list[str]:
    return sorted(
        p.name.replace("-", "_")
        for p in (ROOT / "packages").iterdir()
        if (p / "setup.py").exists() and p.name != "opscommon"
    )


def main(argv: list[str]) -> int:
    names = argv or op_packages()
    print(
        f"torch {torch.__version__} (CUDA {torch.version.cuda}), "
        f"GPU: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}"
    )
    failed = []
    for name in names:
        try:
            mod = importlib.import_module(name)
            build = mod._runtime.BUILD_INFO
            print(
                f"\n{name} {mod.__version__} ({'CUDA ' + build['cuda'] if build.get('cuda') else 'CPU'} build, "
                f"built with torch {build['torch_built_with']})"
            )
            ops = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith(f"{name}::"))
            for op in ops:
                schema = torch._C._dispatch_dump(op).splitlines()[1].removeprefix("schema: ")
                print(f"  op {schema}")
            demo = DEMOS.get(name)
            if demo is None:
                print("  (no demo for this package yet: add one to scripts/demo.py)")
                continue
            for device in _devices(mod):
                print(f" on {device}:")
                demo(mod, device)
        except Exception:  # noqa: BLE001 - report every package, then fail
            traceback.print_exc()
            failed.append(name)
    print()
    if failed:
        print(f"demo FAILED for: {', '.join(failed)}")
        return 1
    print(f"demo: {len(names)} op package(s) built and working")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
