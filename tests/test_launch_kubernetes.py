"""``composer-par launch --kubernetes``: the TrainJob (Kubeflow Trainer v2) and the
PyTorchJob (training operator v1) it writes are valid against the CRDs Kubeflow
publishes (kept in tests/data/kubeflow, SOURCE.md names them), read strictly as the API
server's strict field validation does (a field the schema does not declare is an error),
with the CRD's own name rules; and their fields say what the plan says."""

from __future__ import annotations

import copy
import gzip
import hashlib
import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from composer_par.cli.main import main as cli

DATA = Path(__file__).parent / "data" / "kubeflow"
EXAMPLES = Path(__file__).parent.parent / "examples" / "plans"
TRAINJOB = ("trainer.kubeflow.org_trainjobs.yaml.gz", "v1alpha1")
PYTORCHJOB = ("kubeflow.org_pytorchjobs.yaml.gz", "v1")


@cache
def crd(name: str) -> dict[str, Any]:
    raw = gzip.decompress((DATA / name).read_bytes())
    listed = re.search(rf"`{re.escape(name)}`.*\| ([0-9a-f]{{64}}) \|$",
                       (DATA / "SOURCE.md").read_text(), flags=re.MULTILINE)
    assert listed, f"{name} has no row in SOURCE.md"
    assert hashlib.sha256(raw).hexdigest() == listed.group(1), f"{name} is not the published file"
    return yaml.safe_load(raw)  # type: ignore[no-any-return]


def _strict(schema: Any) -> Any:
    """The schema with every object closed to fields it does not declare, as the API
    server's strict field validation (kubectl --validate=strict) treats them; objects
    that keep unknown fields, or declare additionalProperties, stay as they are."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def validate(document: dict[str, Any], which: tuple[str, str]) -> list[str]:
    """Every way ``document`` breaks the CRD's schema of its version, as text."""
    definition = crd(which[0])
    [version] = [v for v in definition["spec"]["versions"] if v["name"] == which[1]]
    schema = version["schema"]["openAPIV3Schema"]
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
              for e in jsonschema.Draft7Validator(_strict(schema)).iter_errors(document)]
    # The CRD's checks of the whole object are CEL rules; those on the name are regexes
    # and a length, checked here as the API server would.
    name = document.get("metadata", {}).get("name", "")
    for rule in schema.get("x-kubernetes-validations", []):
        pattern = re.search(r"self\.metadata\.name\.matches\('(.+)'\)", rule["rule"])
        length = re.search(r"size\(self\.metadata\.name\) <= (\d+)", rule["rule"])
        if pattern and not re.fullmatch(pattern.group(1), name):
            errors.append(f"metadata.name: {rule['message']}")
        if length and len(name) > int(length.group(1)):
            errors.append(f"metadata.name: {rule['message']}")
    assert document["apiVersion"] == f"{definition['spec']['group']}/{which[1]}"
    assert document["kind"] == definition["spec"]["names"]["kind"]
    return errors


def launch(*args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    code = cli(["launch", "--json", "--dry-run", *args])
    return code, json.loads(capsys.readouterr().out)


def test_the_crds_are_kubeflow_s_and_read_whole() -> None:
    trainjob, pytorchjob = crd(TRAINJOB[0]), crd(PYTORCHJOB[0])
    assert trainjob["metadata"]["name"] == "trainjobs.trainer.kubeflow.org"
    assert pytorchjob["metadata"]["name"] == "pytorchjobs.kubeflow.org"
    # The top-level rules the name check above reads: if the CRD adds others, look again.
    rules = trainjob["spec"]["versions"][0]["schema"]["openAPIV3Schema"][
        "x-kubernetes-validations"]
    assert len(rules) == 2 and all("metadata.name" in r["rule"] for r in rules)


def test_the_trainjob_is_valid_and_says_what_the_plan_says(
        capsys: pytest.CaptureFixture[str]) -> None:
    plan = EXAMPLES / "hsdp_fsdp_tp.toml"  # [topology] 2 nodes x 4
    code, data = launch(str(plan), "--kubernetes", "--image", "registry.example/train:1",
                        "--namespace", "research", "--gpus-per-node", "4", "--env",
                        "NCCL_DEBUG=WARN", "--", "train.py", "plan.toml", "--steps", "100",
                        capsys=capsys)
    assert code == 0, data
    job = data["manifest"]
    assert validate(job, TRAINJOB) == []
    assert yaml.safe_load(data["text"]) == job  # the YAML written is the manifest
    trainer = job["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (2, 4)
    assert trainer["resourcesPerNode"] == {"limits": {"nvidia.com/gpu": 4}}
    assert trainer["command"] == ["torchrun", "train.py", "plan.toml", "--steps", "100"]
    assert trainer["image"] == "registry.example/train:1"
    assert {e["name"]: e["value"] for e in trainer["env"]} == {
        "COMPOSER_PAR_TOPOLOGY": "2x4", "NCCL_DEBUG": "WARN"}
    assert job["spec"]["runtimeRef"] == {"name": "torch-distributed"}
    assert job["metadata"] == {"name": "hsdp-fsdp-tp", "namespace": "research"}


@pytest.mark.parametrize("nodes", [1, 3])
def test_the_pytorchjob_is_valid_and_says_what_the_plan_says(
        nodes: int, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    plan = tmp_path / "plan.toml"
    plan.write_text(f"[mesh]\ndp_replicate = {nodes}\ndp_shard = 2\n\n[topology]\n"
                    f"nodes = {nodes}\ndevices_per_node = 2\n\n[[plugins]]\nname = \"hsdp\"\n"
                    "\n[[plugins]]\nname = \"fsdp2\"\n")
    code, data = launch(str(plan), "--kubernetes", "--pytorchjob", "--image", "img:2",
                        "--max-restarts", "2", "--", "train.py", capsys=capsys)
    assert code == 0, data
    job = data["manifest"]
    assert validate(job, PYTORCHJOB) == []
    assert yaml.safe_load(data["text"]) == job
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert job["spec"]["nprocPerNode"] == "2"
    assert specs["Master"]["replicas"] == 1
    assert specs.get("Worker", {}).get("replicas", 0) == nodes - 1
    for spec in specs.values():
        [container] = spec["template"]["spec"]["containers"]
        assert container["name"] == "pytorch"  # where the controller sets its variables
        assert container["command"] == ["torchrun", "--max-restarts=2", "train.py"]
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env == {"COMPOSER_PAR_TOPOLOGY": f"{nodes}x2",
                       "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def test_the_validation_here_catches_what_the_api_server_refuses(
        capsys: pytest.CaptureFixture[str]) -> None:
    _, data = launch(str(EXAMPLES / "hsdp_fsdp_tp.toml"), "--kubernetes", "--image", "i",
                     "--", "train.py", capsys=capsys)
    good = data["manifest"]
    wrong_type = copy.deepcopy(good)
    wrong_type["spec"]["trainer"]["numNodes"] = "2"
    misspelled = copy.deepcopy(good)
    misspelled["spec"]["trainer"]["numProcsPerNode"] = 4
    bad_name = copy.deepcopy(good)
    bad_name["metadata"]["name"] = "Hsdp_Job"
    assert any("numNodes" in e for e in validate(wrong_type, TRAINJOB))
    assert any("numProcsPerNode" in e for e in validate(misspelled, TRAINJOB))
    assert any(e.startswith("metadata.name") for e in validate(bad_name, TRAINJOB))
    _, data = launch(str(EXAMPLES / "hsdp_fsdp_tp.toml"), "--kubernetes", "--pytorchjob",
                     "--image", "i", "--", "train.py", capsys=capsys)
    replicas = copy.deepcopy(data["manifest"])
    replicas["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = "one"
    assert any("replicas" in e for e in validate(replicas, PYTORCHJOB))


def test_a_kubernetes_job_needs_an_image_and_a_name_kubernetes_takes(
        capsys: pytest.CaptureFixture[str]) -> None:
    plan = str(EXAMPLES / "hsdp_fsdp_tp.toml")
    code, data = launch(plan, "--kubernetes", "--", "train.py", capsys=capsys)
    assert code == 1 and [f["code"] for f in data["findings"]] == ["CP983"]
    assert "manifest" not in data
    code, data = launch(plan, "--kubernetes", "--image", "i", "--name", "Hsdp_Job", "--",
                        "train.py", capsys=capsys)
    assert code == 1 and [f["code"] for f in data["findings"]] == ["CP985"]
    assert "'Hsdp_Job'" in data["findings"][0]["message"]
