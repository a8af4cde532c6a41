"""docs/deployment.md's configurations, checked without a cluster: the Ray cluster YAML passes Ray's own cluster
launcher validation (`prepare_config` + `validate_config`, what `ray up` runs first; the Ray the `ray` extra pins),
the KubeRay manifest is consistent with itself and with the command it documents (KubeRay's schema is not installed
here: only its shape is checked), and every `omnijax serve` command line on the page parses with the server's own
argument parser, its `--snapshot-every` included, and its `--snapshot-dir` (two shared directories, one object-store
URL) is a location the server accepts."""

import re
import shlex
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

from omnijax.serve import launch  # noqa: E402
from omnijax.serve.engine import snapshot_paths  # noqa: E402

DOC = Path(__file__).resolve().parents[3] / "docs" / "deployment.md"


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", DOC.read_text(), flags=re.S)


def _serve_commands() -> list[list[str]]:
    """The `omnijax serve` command lines of the page's bash blocks (continuations joined), from `serve` on."""
    commands = []
    for block in _blocks("bash"):
        text = block.replace("\\\n", " ")
        for match in re.finditer(r"omnijax serve ([^\n'&>]*)", text):
            commands.append(shlex.split(match.group(1).replace('"$OMNIJAX_API_KEY"', "KEY")))
    return commands


def test_the_ray_cluster_yaml_passes_rays_validation():
    pytest.importorskip("ray.autoscaler")
    from ray.autoscaler._private.util import prepare_config, validate_config

    (block,) = [b for b in _blocks("yaml") if "provider:" in b]
    config = yaml.safe_load(block)
    prepared = prepare_config(config)
    validate_config(prepared)  # raises on a field Ray does not know, a missing one, a wrong type
    workers = config["provider"]["worker_ips"]
    assert prepared["max_workers"] == len(workers) and len(set(workers)) == len(workers)
    head_port = re.search(r"--port=([0-9]+)", " ".join(config["head_start_ray_commands"])).group(1)
    assert any(f"$RAY_HEAD_IP:{head_port}" in c for c in config["worker_start_ray_commands"])
    with pytest.raises(Exception, match="not_a_field"):  # the validation does refuse what Ray does not know
        validate_config(prepare_config({**config, "not_a_field": 1}))


def test_the_kuberay_manifest_agrees_with_itself_and_the_command():
    (block,) = [b for b in _blocks("yaml") if "kind: RayCluster" in b]
    cluster, claim = list(yaml.safe_load_all(block))
    assert (cluster["apiVersion"], cluster["kind"]) == ("ray.io/v1", "RayCluster")
    assert (claim["kind"], claim["spec"]["accessModes"]) == ("PersistentVolumeClaim", ["ReadWriteMany"])
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    (group,) = cluster["spec"]["workerGroupSpecs"]
    worker = group["template"]["spec"]
    (kube_command,) = [c for c in _serve_commands() if "/models/omnijax" in c]
    args = launch.build_parser("serve").parse_args(kube_command)
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == args.replicas
    assert worker["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1  # one replica per GPU
    ports = {p["name"]: p["containerPort"] for p in head["containers"][0]["ports"]}
    assert ports["serve"] == args.port and ports["gcs"] == 6379
    for spec in (head, worker):  # every pod mounts the claim where --snapshot-dir points
        (volume,) = spec["volumes"]
        (mount,) = spec["containers"][0]["volumeMounts"]
        assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
        assert mount["name"] == volume["name"] and args.snapshot_dir.startswith(mount["mountPath"] + "/")


def test_every_documented_serve_command_parses():
    commands = _serve_commands()
    assert len(commands) == 3, commands  # the machines', the Kubernetes one and the object store's
    kinds = []
    for command in commands:
        args = launch.build_parser("serve").parse_args(command)
        assert args.replicas >= 2 and args.host == "0.0.0.0" and args.api_key == "KEY", command
        assert launch.snapshot_options(args)["snapshot_every_s"] == 30.0, command
        kinds.append(type(snapshot_paths.location(args.snapshot_dir)).__name__)  # a path or a kvstore URL
    assert sorted(kinds) == ["KvUrl", "PosixPath", "PosixPath"], kinds
