"""How the shipped site templates behave on real clusters: what srun gets (CPUs, GPU binding),
requeue and wckey, Frontier's read-only home and RCCL plugin, the signal lead, and the address the
store publishes on a multi-node job. No SLURM is needed."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from launch.render import Request, render
from launch.site import load_site
from nereus.errors import ConfigError
from nereus.runtime import rendezvous
from nereus.runtime.rendezvous import interface_address, named_interface, node_address
from tests.test_launch import FOLDER, PPO_TINY, PYTHON, ROOT, SWEEP, launch
from tests.test_launch_hardening import LOCAL_SITE, refused, site_file

pytestmark = pytest.mark.pure


@pytest.fixture
def factory() -> Any:
    from tests.test_launch import FakeExecutor

    return FakeExecutor


def request(**changes: Any) -> Request:
    fields: dict[str, Any] = dict(job_name="j", folder=FOLDER, python=PYTHON, nodes=2, tasks_per_node=8,
                                  time_min=120)  # fmt: skip
    return Request(**{**fields, **changes})


def srun_line(sbatch: str) -> str:
    (line,) = [x for x in sbatch.splitlines() if x.startswith("srun ")]
    return line


def sbatch_flags(sbatch: str) -> list[str]:
    return [x.removeprefix("#SBATCH ") for x in sbatch.splitlines() if x.startswith("#SBATCH ")]


# ------------------------------------------------------------------ 1: srun gets the task's CPUs
@pytest.mark.parametrize("name", ["frontier", "nvidia", "local"])
def test_srun_gets_the_cpus_per_task_sbatch_gets(name: str) -> None:
    """srun reads no SLURM_CPUS_PER_TASK since Slurm 22.05: the flag is on its line, as on sbatch's."""
    site = load_site(name)
    for req in (request(), request(launcher="torchrun"), request(nodes=1, tasks_per_node=1, array=3)):
        text = render(site, req).sbatch
        cpus = site.cpus_per_task * (req.tasks_per_node if req.launcher == "torchrun" else 1)
        assert f"--cpus-per-task={cpus}" in sbatch_flags(text)
        assert f" --cpus-per-task={cpus} " in srun_line(text)
        assert "SRUN_CPUS_PER_TASK" not in text


def test_a_site_may_not_set_srun_cpus_itself(tmp_path: Path, capsys: Any) -> None:
    site = tmp_path / "s.yaml"
    for arg in ("--cpus-per-task=4", "-c4", "--cpus-per=2"):
        site.write_text(f"vendor: cpu\nsrun_args: ['{arg}']\n")
        code, _, err = launch(["submit", str(PPO_TINY), "--site", str(site), "--dry-run"], capsys)
        assert code == 2 and f"srun_args: '{arg}' is not an srun flag the site may set" in err, err
    site.write_text("vendor: cpu\nsrun_args: ['--cpu-bind=cores']\n")  # another flag: allowed
    code, out, err = launch(["submit", str(PPO_TINY), "--site", str(site), "--dry-run"], capsys)
    assert code == 0 and "--cpu-bind=cores" in srun_line(out), err


# ------------------------------------------------------------------ 2, 3: requeue always, the site's wckey
@pytest.mark.parametrize("name", ["frontier", "nvidia", "local"])
def test_every_job_is_requeueable_and_has_no_wckey_of_submitits(name: str) -> None:
    for req in (request(), request(nodes=1, tasks_per_node=1, array=2), request(launcher="torchrun")):
        flags = sbatch_flags(render(load_site(name), req).sbatch)
        assert "--requeue" in flags and not any(f.startswith("--wckey") for f in flags), flags
        assert not any(f.startswith("--no-requeue") for f in flags)


def test_a_site_sets_its_own_wckey_but_never_requeue(tmp_path: Path, capsys: Any, factory: Any) -> None:
    path = site_file(tmp_path, sbatch={"wckey": "rl-team"})
    code, out, err = launch(["submit", str(PPO_TINY), "--site", str(path), "--dry-run"], capsys)
    assert code == 0 and "#SBATCH --wckey=rl-team" in out.splitlines(), err
    for key in ("requeue", "no-requeue"):
        path = site_file(tmp_path, sbatch={key: True})
        code, _, err = launch(["submit", str(PPO_TINY), "--site", str(path), "--dry-run"], capsys)
        assert code == 2 and f"sbatch: '{key}' is not a flag the site may set" in err, err


def test_the_sbatch_submitit_writes_has_requeue_and_no_wckey(monkeypatch: pytest.MonkeyPatch) -> None:
    import submitit

    monkeypatch.setattr(submitit.SlurmExecutor, "affinity", classmethod(lambda cls: 2))
    rendered = render(load_site("frontier"), request())
    ex = submitit.SlurmExecutor(folder=FOLDER, python=PYTHON)
    ex.update_parameters(**rendered.params)
    text = ex._make_submission_file_text(ex._submitit_command_str, "uid")
    assert text == rendered.sbatch and "--requeue" in sbatch_flags(text) and "wckey" not in text


# ------------------------------------------------------------------ 4: one GPU per task, closest to its cores
@pytest.mark.parametrize("name", ["frontier"])
def test_gpu_sites_bind_one_gpu_per_task_to_its_closest_cores(name: str) -> None:
    """Frontier binds each task one GCD, its closest (OLCF's recipe); NVIDIA does not (a device
    cgroup would cut NVLink P2P between the tasks' GPUs): every task sees all and takes its own."""
    srun = srun_line(render(load_site(name), request()).sbatch)
    assert " --gpus-per-task=1 --gpu-bind=closest " in srun, srun
    assert "#SBATCH --gpus-per-node=8" in render(load_site(name), request()).sbatch
    assert "--gpus-per-task" not in srun_line(render(load_site("nvidia"), request()).sbatch)
    # a torchrun agent's task holds its node's 8 GPUs, an array task none: no per-task binding
    for req in (request(launcher="torchrun"), request(nodes=1, tasks_per_node=1, array=2)):
        srun = srun_line(render(load_site(name), req).sbatch)
        assert "--gpus-per-task" not in srun and "--gpu-bind" not in srun, srun


# ------------------------------------------------------------------ 7: a read-only home
def test_frontier_refuses_a_job_folder_under_home(
    tmp_path: Path, capsys: Any, factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    exp = tmp_path / "exp.yaml"
    exp.write_text(yaml.safe_dump({**yaml.safe_load(PPO_TINY.read_text()), "cluster": "mi250x-slingshot"}))
    args = ["submit", str(exp), "--site", "frontier", "--nodes", "1"]
    for root in (home / "jobs", home / "a" / "b"):
        _, _, err = refused([*args, "--jobs-root", str(root)], "--jobs-root: the job folder", tmp_path,
                            capsys, factory)  # fmt: skip
        assert f"is under $HOME ({home}), which site frontier's compute nodes cannot write" in err, err
        assert "pass --jobs-root on a file system they write such as $MEMBERWORK/<project>/jobs" in err
        assert not root.exists()
    # the default --jobs-root is "jobs" in the current folder: under $HOME there, refused too
    monkeypatch.chdir(home)
    code, out, err = launch(args, capsys, factory=factory)
    assert code == 2 and not out and f"the job folder '{home}/jobs/ppo-tiny-" in err, err
    assert len(err.splitlines()) == 1 and not (home / "jobs").exists()
    link = tmp_path / "link-to-home"  # a symbolic link into the home is found out
    link.symlink_to(home)
    refused([*args, "--jobs-root", str(link / "jobs")], "is under $HOME", tmp_path, capsys, factory)
    # elsewhere (a scratch file system): submitted
    code, out, err = launch([*args, "--jobs-root", str(tmp_path / "scratch"), "--dry-run"], capsys)
    assert code == 0 and out.startswith("#!/bin/bash"), err
    # a job array too
    refused(["array", str(SWEEP), "--site", "frontier", "--jobs-root", str(home / "j")], "is under $HOME",
            tmp_path, capsys, factory)  # fmt: skip


def test_read_only_roots_in_a_site_file(tmp_path: Path, capsys: Any, factory: Any) -> None:
    ro = tmp_path / "ro"
    path = site_file(tmp_path, read_only_roots=[str(ro)])
    _, _, err = refused(["submit", str(PPO_TINY), "--site", str(path), "--jobs-root", str(ro / "x")],
                        f"is under {ro}, which site mysite's compute nodes cannot write: pass --jobs-root "
                        "on a file system they write\n", tmp_path, capsys, factory)  # fmt: skip
    code, _, err = launch(["submit", str(PPO_TINY), "--site", str(path), "--jobs-root", str(tmp_path / "rw"),
                           "--dry-run"], capsys)  # fmt: skip
    assert code == 0, err
    code, _, err = launch(["submit", str(PPO_TINY), "--site", str(path), "--jobs-root", str(ro), "--local",
                           "--dry-run"], capsys)  # fmt: skip
    assert code == 0, err  # local processes run here, where it was writable
    unset = site_file(tmp_path, read_only_roots=["$NEREUS_NO_SUCH_VARIABLE/x"])
    code, _, err = launch(["submit", str(PPO_TINY), "--site", str(unset), "--dry-run"], capsys)
    assert code == 0, err  # unset where it is read: nothing to compare with
    for bad in (["relative/path"], ["/ok", ""], "not-a-list"):
        path = site_file(tmp_path, read_only_roots=bad)
        code, _, err = launch(["submit", str(PPO_TINY), "--site", str(path), "--dry-run"], capsys)
        assert code == 2 and "read_only_roots" in err and len(err.splitlines()) == 1, err
    path = site_file(tmp_path, read_only_roots=["/x\n/y"])
    code, _, err = launch(["submit", str(PPO_TINY), "--site", str(path), "--dry-run"], capsys)
    assert code == 2 and "read_only_roots[0]" in err and "control characters" in err, err


def test_the_shipped_sites_read_only_roots() -> None:
    assert load_site("frontier").read_only_roots == ("$HOME",)
    assert load_site("nvidia").read_only_roots == () and load_site("local").read_only_roots == ()


# ------------------------------------------------------------------ 8: RCCL's Slingshot plugin
def frontier_setup() -> str:
    """The setup part of Frontier's script, without its module loads (no modules here)."""
    text = render(load_site("frontier"), request()).sbatch
    setup = text.split("# setup\n", 1)[1].split("\n# command\n", 1)[0]
    return "\n".join(line for line in setup.splitlines() if not line.startswith("module "))


def bash(script: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", script], env=env, capture_output=True, text=True, timeout=30, check=False
    )


def test_frontier_loads_the_rccl_plugin_or_stops_early(tmp_path: Path) -> None:
    setup = frontier_setup()
    assert "export NCCL_NET='AWS Libfabric'" in setup  # a plugin that fails to load is an error, not TCP
    env = {"PATH": os.environ["PATH"], "LD_LIBRARY_PATH": "/opt/rocm/lib"}
    script = setup + '\necho "LD=$LD_LIBRARY_PATH NET=$NCCL_NET"\n'
    done = bash(script, env)
    assert done.returncode == 2 and not done.stdout, done
    want = (
        "site frontier: set NEREUS_RCCL_PLUGIN_DIR to the aws-ofi-rccl plugin lib folder (librccl-net.so) "
        "before submitting, got ''\n"
    )
    assert done.stderr == want, done
    missing = {**env, "NEREUS_RCCL_PLUGIN_DIR": str(tmp_path / "nowhere")}
    done = bash(script, missing)
    assert done.returncode == 2 and "nowhere" in done.stderr, done
    plugin = tmp_path / "aws-ofi-rccl" / "lib"
    plugin.mkdir(parents=True)
    for ld, want in (("/opt/rocm/lib", f"{plugin}:/opt/rocm/lib"), (None, str(plugin))):
        run_env = {**env, "NEREUS_RCCL_PLUGIN_DIR": str(plugin)}
        if ld is None:
            del run_env["LD_LIBRARY_PATH"]
        done = bash(script, run_env)
        assert done.returncode == 0 and done.stdout == f"LD={want} NET=AWS Libfabric\n", done


def test_the_rccl_plugin_is_documented() -> None:
    docs = (ROOT / "docs" / "launcher.md").read_text()
    template = (ROOT / "slurm" / "templates" / "frontier.yaml").read_text()
    for text in (docs, template):
        assert "NEREUS_RCCL_PLUGIN_DIR" in text and "aws-ofi-rccl" in text and "NCCL_NET" in text


# ------------------------------------------------------------------ 9: the signal lead
def test_gpu_sites_warn_ten_minutes_before_the_time_limit() -> None:
    for name in ("frontier", "nvidia"):
        site = load_site(name)
        assert site.signal_delay_s == 600
        assert "#SBATCH --signal=USR2@600" in render(site, request()).sbatch
        assert "--shutdown-timeout=600" in render(site, request(launcher="torchrun")).command
    assert load_site("local").signal_delay_s == LOCAL_SITE["signal_delay_s"]
    assert "longest step plus" in (ROOT / "docs" / "launcher.md").read_text()


def test_a_time_limit_inside_the_lead_is_refused(tmp_path: Path, capsys: Any, factory: Any) -> None:
    exp = tmp_path / "exp.yaml"
    exp.write_text(yaml.safe_dump({**yaml.safe_load(PPO_TINY.read_text()), "cluster": "mi250x-slingshot"}))
    refused(["submit", str(exp), "--site", "frontier", "--nodes", "1", "--time", "10"],
            "--time: 10 min is not longer than site frontier's signal_delay_s 600 s", tmp_path, capsys,
            factory)  # fmt: skip


# ------------------------------------------------------------------ 6: the store's address
LOOPBACK_HOST = "127.0.1.1"  # Ubuntu's and DGX's /etc/hosts entry for the host name


@pytest.fixture
def loopback_host(monkeypatch: pytest.MonkeyPatch) -> dict[str, str | None]:
    """The host name resolves to 127.0.1.1; interfaces are what the returned dict says."""
    interfaces: dict[str, str | None] = {"lo": "127.0.0.1", "hsn0": "10.1.2.3", "ib0": "10.9.0.7"}
    monkeypatch.setattr(rendezvous, "host_address", lambda: LOOPBACK_HOST)
    monkeypatch.setattr(rendezvous, "interface_address", interfaces.get)
    monkeypatch.setattr(rendezvous.socket, "if_nameindex", lambda: list(enumerate(interfaces, 1)))
    return interfaces


def test_a_multi_node_job_never_publishes_a_loopback_address(loopback_host: dict[str, str | None]) -> None:
    two = {"SLURM_NNODES": "2"}
    assert node_address(env={**two, "NEREUS_RDZV_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "hsn0"}) == "10.9.0.7"
    assert node_address(env={**two, "GLOO_SOCKET_IFNAME": "hsn0", "NCCL_SOCKET_IFNAME": "ib0"}) == "10.1.2.3"
    assert node_address(env={**two, "NCCL_SOCKET_IFNAME": "hsn0,hsn1"}) == "10.1.2.3"  # the first name
    assert node_address(env={**two, "NCCL_SOCKET_IFNAME": "=ib0"}) == "10.9.0.7"  # NCCL's exact match
    assert node_address(env={**two, "NCCL_SOCKET_IFNAME": "ib"}) == "10.9.0.7"  # NCCL's prefix
    assert node_address(env={"NCCL_SOCKET_IFNAME": "ib0"}, nodes=4) == "10.9.0.7"  # the rendezvous knows
    assert node_address(env={**two, "NEREUS_RDZV_HOST": "10.0.0.9"}) == "10.0.0.9"  # explicit wins
    for env, why in (
        (two, "none of NEREUS_RDZV_IFNAME, GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME names an interface"),
        ({**two, "NCCL_SOCKET_IFNAME": "^docker,lo"}, "none of"),  # an exclusion list names none
        ({**two, "GLOO_SOCKET_IFNAME": "eth7"}, "GLOO_SOCKET_IFNAME=eth7 has no IPv4 address on this node"),
        ({**two, "NEREUS_RDZV_IFNAME": "lo"}, "NEREUS_RDZV_IFNAME=lo has only a loopback IPv4 address"),
        ({"SLURM_JOB_NUM_NODES": "3"}, "the job spans 3 nodes"),
    ):
        with pytest.raises(ConfigError) as info:
            node_address(env=env)
        message = str(info.value)
        assert why in message and "\n" not in message, message
        assert f"resolves to {LOOPBACK_HOST}" in message and "set NEREUS_RDZV_IFNAME" in message
        assert "NEREUS_RDZV_HOST" in message


def test_a_multi_node_job_takes_the_host_names_address_when_it_is_not_loopback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(rendezvous, "host_address", lambda: "10.5.5.5")
    monkeypatch.setattr(rendezvous, "interface_address", lambda name: None)
    assert node_address(env={"SLURM_NNODES": "2"}) == "10.5.5.5"
    assert node_address(env={"SLURM_NNODES": "2", "NCCL_SOCKET_IFNAME": "ib9"}) == "10.5.5.5"
    assert node_address(env={}) == "10.5.5.5"


def test_a_single_node_job_works_as_before(loopback_host: dict[str, str | None]) -> None:
    assert node_address(env={}) == LOOPBACK_HOST
    assert node_address(env={"SLURM_NNODES": "1"}) == LOOPBACK_HOST
    # with an interface named, its address: a grown job's newcomers on other nodes can reach it
    assert node_address(env={"SLURM_NNODES": "1", "NCCL_SOCKET_IFNAME": "ib0"}) == "10.9.0.7"
    assert node_address(env={"NCCL_SOCKET_IFNAME": "eth7"}) == LOOPBACK_HOST


def test_interface_addresses_come_from_the_kernel() -> None:
    assert interface_address("lo") == "127.0.0.1"
    assert interface_address("no-such-if0") is None and interface_address("x" * 40) is None
    assert named_interface({"GLOO_SOCKET_IFNAME": " hsn0 , hsn1"}) == ("GLOO_SOCKET_IFNAME", "hsn0")
    assert named_interface({"NCCL_SOCKET_IFNAME": "^lo", "GLOO_SOCKET_IFNAME": ""}) is None


def test_the_local_test_cluster_publishes_loopback_on_purpose() -> None:
    """Its four nodes are this host: the site names the address, so no interface is needed."""
    assert load_site("local").env["NEREUS_RDZV_HOST"] == "127.0.0.1"
    assert node_address(env={"SLURM_NNODES": "4", "NEREUS_RDZV_HOST": "127.0.0.1"}) == "127.0.0.1"
