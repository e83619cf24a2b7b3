"""Vendor a CustomResourceDefinition's served schema for tests/test_deploy.py (offline manifest validation).

    python tests/crd_schemas/vendor.py CRD.yaml VERSION 'owner/repo@tag (commit SHA): path/in/repo'

writes tests/crd_schemas/<group>_<plural>_<version>.json: the `openAPIV3Schema` of that served version, with the
`description` texts left out (they are most of the file and no rule), and where it came from. SOURCES.md lists each.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml


def without_descriptions(node: Any) -> Any:
    """`node` with every schema's `description` removed (a property named "description" stays)."""
    if isinstance(node, dict):
        return {k: (without_descriptions(v) if k != "properties" else
                    {name: without_descriptions(s) for name, s in v.items()})
                for k, v in node.items() if k != "description" or not isinstance(v, str)}
    if isinstance(node, list):
        return [without_descriptions(v) for v in node]
    return node


def main(crd_file: str, version: str, source: str) -> Path:
    crd = yaml.safe_load(Path(crd_file).read_text())
    spec = crd["spec"]
    served = next(v for v in spec["versions"] if v["name"] == version and v.get("served"))
    out = Path(__file__).with_name(f"{spec['group']}_{spec['names']['plural']}_{version}.json")
    out.write_text(json.dumps({
        "source": source,
        "apiVersion": f"{spec['group']}/{version}",
        "kind": spec["names"]["kind"],
        "scope": spec["scope"],
        "openAPIV3Schema": without_descriptions(served["schema"]["openAPIV3Schema"]),
    }, indent=1, sort_keys=True) + "\n")
    return out


if __name__ == "__main__":
    print(main(*sys.argv[1:]))
