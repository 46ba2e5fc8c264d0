import numpy as np
import pytest

from simcluster.program.mesh import DeviceMesh


def test_groups_follow_the_layout_innermost_axis_fastest():
    mesh = DeviceMesh(dp=2, pp=1, cp=3, tp=2)
    grid = np.arange(12).reshape(2, 1, 3, 2)
    for r in range(12):
        d, p, c, t = np.argwhere(grid == r)[0]
        assert mesh.group(r, "tp").ranks == tuple(grid[d, p, c, :])
        assert mesh.group(r, "dp").ranks == tuple(grid[:, p, c, t])
        assert mesh.group(r, "dp", "cp").ranks == tuple(grid[:, p, :, t].reshape(-1))
        assert mesh.coords(r) == {"dp": d, "pp": p, "cp": c, "tp": t}
    assert mesh.group(5).ranks == tuple(range(12)) and mesh.group(5).name == "world"


def test_groups_partition_the_world():
    mesh = DeviceMesh(dp=3, tp=2, cp=2)
    for axes in (("dp",), ("tp",), ("cp", "tp"), ("dp", "cp")):
        members = sorted(r for g in mesh.groups(*axes) for r in g.ranks)
        assert members == list(range(mesh.world_size))


def test_bad_mesh_and_axis_errors_name_the_value():
    with pytest.raises(ValueError, match="mesh axis tp must be a positive integer, got 0"):
        DeviceMesh(tp=0)
    with pytest.raises(ValueError, match="unknown mesh axis 'ep'; valid axes: dp, pp, cp, tp"):
        DeviceMesh(dp=2).group(0, "ep")


def test_members_share_one_group_object_and_groups_survive_pickling():
    import pickle

    from simcluster.program.mesh import ProcessGroup

    mesh = DeviceMesh(dp=2, tp=4)
    g = mesh.group(0, "tp")
    assert all(mesh.group(r, "tp") is g for r in g.ranks)
    assert mesh.group(4, "tp") is not g and mesh.group(4, "tp") != g
    made = ProcessGroup("tp", [np.int64(0), 1, 2, 3])  # ranks become a tuple of ints
    assert made == g and hash(made) == hash(g) and {g: 1}[made] == 1
    back = pickle.loads(pickle.dumps(g))
    assert back == g and hash(back) == hash(g) and str(back) == "tp[0, 1, 2, 3]"


def test_a_group_unpickled_in_another_process_hashes_as_that_process_does():
    # string hashes differ between processes (the spawn runner sends groups to its workers):
    # a cached hash must be made again there, not copied
    import pickle
    import subprocess
    import sys

    g = DeviceMesh(tp=4).group(0, "tp")
    check = ("import pickle, sys; from simcluster.program.mesh import ProcessGroup; "
             "g = pickle.loads(sys.stdin.buffer.read()); "
             "assert hash(g) == hash(ProcessGroup('tp', (0, 1, 2, 3))) and {g: 1}[ProcessGroup('tp', (0, 1, 2, 3))] == 1")
    for seed in ("1", "2"):
        done = subprocess.run([sys.executable, "-c", check], input=pickle.dumps(g), capture_output=True,
                              env={"PYTHONHASHSEED": seed, "PATH": ""})
        assert done.returncode == 0, done.stderr.decode()
