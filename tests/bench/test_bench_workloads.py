"""``flexgroup bench <workload>`` reaches each workload's own command line."""

import pytest

from flexgroup import bench


@pytest.mark.parametrize("name", sorted(bench.WORKLOADS))
def test_each_workload_has_its_own_help(name, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main([name, "--help"])
    assert e.value.code == 0
    assert f"flexgroup bench {name}" in capsys.readouterr().out


def test_the_grid_help_lists_the_workloads(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    out = capsys.readouterr().out
    assert all(f"flexgroup bench {name}" in out for name in bench.WORKLOADS)
