"""A ``.pt2`` made with one torch release runs in another (``nox -s
deploy_across``): the stable-ABI promise, for the deployed artifact.

    python scripts/deploy_across.py export DIR [PACKAGE ...]
        In the environment of the older torch: for each op package, the model
        of its tests/test_deploy_<op>.py exported and compiled with
        AOTInductor into DIR/<op>/model.pt2, with its sample inputs and eager
        outputs (DIR/<op>/cases.pt) and the torch that made them.
    python scripts/deploy_across.py run DIR [--json FILE]
        In the environment of the newer torch (the same op wheels installed):
        each package run in a fresh Python and by the C++ runner built against
        this torch's libtorch; outputs compared with the saved eager ones.

CPU only: the models are exported on CPU tensors.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def _test_module(package: str):
    import_name = package.replace("-", "_")
    path = ROOT / "packages" / package / "tests" / f"test_deploy_{import_name}.py"
    spec = importlib.util.spec_from_file_location(f"_deploy_{import_name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def export(out: Path, packages: list[str]) -> None:
    from opscommon import deploy

    for package in packages:
        t = _test_module(package)
        torch.manual_seed(0)
        model = t.Model().eval()
        folder = out / t.MODULE
        folder.mkdir(parents=True, exist_ok=True)
        deploy.export_and_package(model, t.example_inputs("cpu"), t.DYNAMIC_SHAPES, folder / "model.pt2")
        cases = []
        for inputs in t.sample_inputs("cpu"):
            with torch.no_grad():
                outs = model(*inputs)
            cases.append({"inputs": inputs, "outputs": list(outs) if isinstance(outs, tuple) else [outs]})
        torch.save(cases, folder / "cases.pt")
        (folder / "made_with.txt").write_text(torch.__version__)
        print(f"{t.MODULE}: {folder / 'model.pt2'} made with torch {torch.__version__}")


def run(folder: Path, json_out: Path | None) -> int:
    from opscommon import deploy

    runner = deploy.build_runner()
    results, failed = [], 0
    for case_dir in sorted(p for p in folder.iterdir() if (p / "model.pt2").is_file()):
        module = case_dir.name
        made_with = (case_dir / "made_with.txt").read_text().strip()
        package = case_dir / "model.pt2"
        cases = torch.load(case_dir / "cases.pt", weights_only=True)
        library = deploy.library_path(module)
        status, detail = "pass", f"made with torch {made_with}, run with torch {torch.__version__}"
        try:
            for case in cases:
                outs = deploy.run_in_fresh_python(package, module, case["inputs"])
                deploy.assert_same_outputs(outs, case["outputs"], "cpu")
                outs, _ = deploy.run_in_cpp(runner, package, [library], case["inputs"])
                deploy.assert_same_outputs(outs, case["outputs"], "cpu")
            detail += f": {len(cases)} input sets, fresh Python and C++ runner equal eager"
        except Exception as exc:  # report every package, not just the first failure
            status, detail = "fail", f"{detail}: {exc}"
            failed += 1
        print(f"{module}: {status}: {detail}")
        results.append({"module": module, "status": status, "detail": detail})
    if not results:
        print(f"no packages in {folder}")
        failed = 1
    if json_out is not None:
        json_out.write_text(json.dumps(results, indent=1))
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_export = sub.add_parser("export")
    p_export.add_argument("dir", type=Path)
    p_export.add_argument("packages", nargs="*", default=["round-op", "vecadd-op", "lltm-op"])
    p_run = sub.add_parser("run")
    p_run.add_argument("dir", type=Path)
    p_run.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.command == "export":
        export(args.dir, args.packages)
        return 0
    return run(args.dir, args.json)


if __name__ == "__main__":
    sys.exit(main())
