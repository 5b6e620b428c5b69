"""The planner's data files are package data of bench.plan.data, read through
importlib.resources: they are found from any working directory, and never by a path
beside the code."""

from __future__ import annotations

import ast
import importlib.resources
from pathlib import Path

import bench.plan.specs as specs
from bench.plan.specs import known_models, load_model, load_system, system_names


def test_data_is_a_package_with_its_json_files():
    data = importlib.resources.files("bench.plan.data")
    assert {"models.json", "systems.json"} <= {p.name for p in data.iterdir()}


def test_specs_load_through_importlib_resources_from_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    asked = []
    real = importlib.resources.files

    def spy(package):
        asked.append(package)
        return real(package)

    monkeypatch.setattr(specs, "files", spy)
    assert load_system("h200_sxm").hbm_gbps == 4800
    assert "h100_sxm" in system_names() and "cpu-local" in system_names()
    assert load_model("smollm2-135m-instruct").layers == 30
    assert "Qwen/Qwen3-32B" in known_models()
    assert asked and set(asked) == {"bench.plan.data"}


def test_specs_has_no_path_to_its_data():
    tree = ast.parse(Path(specs.__file__).read_text())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert "__file__" not in names
