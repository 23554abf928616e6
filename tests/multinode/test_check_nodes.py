"""`%nbtrain check --hosts` on simulated nodes: the probe runs on each node over real SSH, in
parallel, and each node reports its own host name; an unreachable host gets a row of its own."""

from __future__ import annotations

import nbtrain

from .testbed import Testbed


def test_check_two_hosts_over_ssh(ip, testbed: Testbed, capsys) -> None:
    hosts = ",".join(testbed.names[:2])
    r = nbtrain.check(hosts=hosts, ssh_args=testbed.ssh_args, remote_python=testbed.remote_python)
    assert r.source == "ssh" and r.failed == {}
    assert [n["hostname"] for n in r.nodes] == testbed.names[:2]
    assert r.ok, r.advice()
    # the magic, with the same ssh options given as a string
    ssh_args = " ".join(testbed.ssh_args)
    ip.run_line_magic("nbtrain", f"check --hosts {hosts} --ssh-args '{ssh_args}'")
    out = capsys.readouterr().out
    for name in testbed.names[:2]:
        assert f"  {name} " in out
    assert "2 node(s) agree: nothing odd." in out


def test_a_cut_node_is_listed_and_the_other_still_checked(testbed: Testbed) -> None:
    first, second = testbed.names[:2]
    testbed.cut(second)
    try:
        r = nbtrain.check(
            hosts=f"{first},{second}",
            ssh_args=testbed.ssh_args,
            remote_python=testbed.remote_python,
            timeout=10,
        )
    finally:
        testbed.restore(second)
    assert [n["hostname"] for n in r.nodes] == [first], r.failed
    assert list(r.failed) == [second] and not r.ok
    assert second in r.advice()[0]
