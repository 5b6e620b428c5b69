"""The wheel carries everything the code opens: build it, unpack it outside the checkout,
and run `pdserve plan` and `pdserve k8s render` from there with `python -I -S` (no editable
finder, no checkout on the path; the base dependencies come from this interpreter's
site-packages, added without processing its .pth files)."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("serve", "router", "kvtransfer", "bench")


def test_every_package_of_the_tree_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    tree = {".".join(p.parent.relative_to(ROOT).parts) for pkg in PACKAGES for p in (ROOT / pkg).rglob("__init__.py")}
    assert tree - listed == set(), "packages missing from pyproject.toml"
    assert listed - tree == {"serve.deploy.manifests"}, "listed but not in the tree"
    assert "k8s" not in listed


@pytest.fixture(scope="module")
def unpacked_wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(ROOT)], check=True, cwd=out, timeout=300)
    (wheel,) = out.glob("pdserve-*.whl")
    site = out / "site"
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        z.extractall(site)
    assert not any(n.startswith("k8s/") for n in names), "a top-level k8s package in the wheel"
    assert "serve/deploy/manifests/base/kustomization.yaml" in names
    assert "bench/plan/data/systems.json" in names
    return site


def _pdserve(site: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    purelib = sysconfig.get_paths()["purelib"]
    platlib = sysconfig.get_paths()["platlib"]
    code = ("import sys; sys.path[:0] = [sys.argv[1]]; sys.path += sys.argv[2:4]; "
            "import serve, bench; assert serve.__file__.startswith(sys.argv[1]), serve.__file__; "
            "assert bench.__file__.startswith(sys.argv[1]), bench.__file__; "
            "from serve.cli import main; sys.exit(main(sys.argv[4:]))")
    return subprocess.run([sys.executable, "-I", "-S", "-c", code, str(site), purelib, platlib, *args],
                          cwd=cwd, capture_output=True, text=True, timeout=300)


def test_the_installed_wheel_plans_and_renders_outside_the_checkout(unpacked_wheel, tmp_path):
    plan_dir, out = tmp_path / "plan", tmp_path / "manifests"
    r = _pdserve(unpacked_wheel, tmp_path, "plan", "--model", "nvidia/Llama-3.1-Nemotron-Nano-4B-v1.1",
                 "--system", "h200_sxm", "--total-gpus", "4", "--isl", "4000", "--osl", "500", "--ttft", "600",
                 "--tpot", "16.67", "--save-dir", str(plan_dir))
    assert r.returncode == 0, r.stdout + r.stderr
    plan = json.loads((plan_dir / "plan.json").read_text())
    assert plan["schema"] == "pdserve.plan/1" and plan["winner"] in ("agg", "disagg")
    r = _pdserve(unpacked_wheel, tmp_path, "k8s", "render", "--plan", str(plan_dir), "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    rendered = sorted(p.relative_to(out).as_posix() for p in out.rglob("*.yaml"))
    assert "kustomization.yaml" in rendered and any("hpa" in p for p in rendered), rendered
