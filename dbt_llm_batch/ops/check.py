"""`dbt-llm-batch check`: every llm_batch model's config, validated from the project's manifest.

No provider is called and the warehouse is not opened: CI runs it after `dbt parse` to fail a typo
(`llm_temprature`) or a bad value before the nightly run. The config a model's run validates is built
the same way (macros/materializations/llm_batch.sql, `_llm_config`: unique_key and every llm_* key)
and parsed by the same code (config.parse_config), so the check and a run agree.
"""

from __future__ import annotations

import json
import os
import sys

from dbt_llm_batch.config import parse_config
from dbt_llm_batch.errors import ConfigError


def raw_config(node: dict) -> dict:
    """What the materialization hands to a run (`_llm_config`): unique_key and every llm_* key of the
    model's config, and with llm_output_from_columns the model's YAML columns (name, data_type,
    description), the keys the table (config_keys.py) reads from the YAML."""
    node_config = node.get("config") or {}
    picked = {"unique_key": node_config.get("unique_key")}
    picked.update({k: v for k, v in node_config.items() if k.startswith("llm_")})
    if picked.get("llm_output_from_columns"):
        picked["columns"] = [
            {"name": name, "data_type": column.get("data_type"), "description": column.get("description")}
            for name, column in (node.get("columns") or {}).items()
        ]
    return picked


def problems(manifest: dict) -> tuple[int, list[str]]:
    """(llm_batch models checked, one text per model with a problem, naming the model and its file)."""
    checked, found = 0, []
    for node in sorted(manifest.get("nodes", {}).values(), key=lambda n: n.get("unique_id", "")):
        config = node.get("config") or {}
        if node.get("resource_type") != "model" or config.get("materialized") != "llm_batch":
            continue
        if config.get("enabled") is False:
            continue
        checked += 1
        where = f"{node['name']} ({node.get('original_file_path', node['unique_id'])})"
        try:
            parse_config(raw_config(node))
        except ConfigError as exc:
            found.append(f"{where}: {exc}")
        contract = config.get("contract") or {}
        if contract.get("enforced"):
            untyped = [c["name"] for c in (node.get("columns") or {}).values() if not c.get("data_type")]
            if not node.get("columns"):
                found.append(f"{where}: the model has an enforced contract, and its 'columns' specification is missing")
            elif untyped:
                found.append(
                    f"{where}: the enforced contract declares columns without a data_type: {', '.join(untyped)}"
                )
    return checked, found


def check(project_dir: str, manifest_path: str | None) -> int:
    path = manifest_path or os.path.join(project_dir, "target", "manifest.json")
    if not os.path.exists(path):
        print(
            f"no dbt manifest at {path}: run `dbt parse` in the project first (or pass --manifest)",
            file=sys.stderr,
        )
        return 2
    with open(path) as f:
        manifest = json.load(f)
    checked, found = problems(manifest)
    for text in found:
        print(text, file=sys.stderr)
    if found:
        print(f"{len(found)} of {checked} llm_batch model(s) have config problems", file=sys.stderr)
        return 1
    print(f"{checked} llm_batch model(s) checked: no problems")
    return 0
