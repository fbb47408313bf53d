"""tools/wan/launch.py with --lsgd-fault-tolerance torchft: one torchrun job per site and a
lighthouse (the commands; a run over namespaces is described in docs/fault_tolerance.md)."""

import importlib.util
from types import SimpleNamespace

import pytest

from tools.wan.launch import elastic_site_jobs, lighthouse_cmd, lighthouse_floor, script_flag


def _value(cmd, flag):
    return cmd[cmd.index(flag) + 1]


def test_each_site_is_a_job_of_its_own_that_torchrun_restarts():
    wan = SimpleNamespace(sites=3, site_ip=lambda i: f"10.77.0.{i + 1}")
    jobs = elastic_site_jobs(wan, 2, ["pretrain_gpt.py", "--lsgd-fault-tolerance", "torchft"], 29500, "/logs", "run",
                             "http://10.77.0.1:29510", 3)
    assert [j.site for j in jobs] == [0, 1, 2]
    cmd = jobs[2].cmd
    assert (_value(cmd, "--nnodes"), _value(cmd, "--node-rank"), _value(cmd, "--nproc-per-node")) == ("1", "0", "2")
    assert _value(cmd, "--master-addr") == "10.77.0.3"  # its own rendezvous, on its own host
    assert _value(cmd, "--max-restarts") == "3"
    assert cmd.index("--max-restarts") < cmd.index("pretrain_gpt.py")  # torchrun's flag, not the script's
    assert (_value(cmd, "--lsgd-site"), _value(cmd, "--lsgd-lighthouse"), _value(cmd, "--lsgd-ft-host")) == \
        ("2", "http://10.77.0.1:29510", "10.77.0.3")
    assert jobs[2].log_path == "/logs/run.site2.log"


def test_the_scripts_flags_are_read_as_argparse_would():
    script = ["pretrain_gpt.py", "--lsgd-min-sites", "2", "--lsgd-fault-tolerance=torchft", "--lsgd-min-sites", "3"]
    assert script_flag(script, "--lsgd-min-sites") == "3"  # the last one wins
    assert script_flag(script, "--lsgd-fault-tolerance") == "torchft"
    assert script_flag(script, "--lsgd-lighthouse") is None


@pytest.mark.skipif(importlib.util.find_spec("torchft") is None, reason="torchft is not installed")
def test_the_lighthouse_takes_the_sites_floor():
    cmd = lighthouse_cmd(2, 29510, 10000)
    assert cmd[0].endswith("torchft_lighthouse")
    assert (_value(cmd, "--min_replicas"), _value(cmd, "--bind"), _value(cmd, "--join_timeout_ms")) == \
        ("2", "[::]:29510", "10000")


def test_the_lighthouse_forms_a_quorum_of_one_site_where_a_site_may_train_alone():
    script = ["pretrain_gpt.py", "--lsgd-fault-tolerance", "torchft", "--lsgd-min-sites", "2"]
    assert lighthouse_floor(script) == 2 and lighthouse_floor(script + ["--lsgd-ft-lone-site", "stop"]) == 2
    assert lighthouse_floor(script + ["--lsgd-ft-lone-site=train"]) == 1
    assert lighthouse_floor(["pretrain_gpt.py"]) == 1
