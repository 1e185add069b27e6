"""launch/world_size.py: how the shell launchers spread TP x PP x DP trainer processes over nodes."""
import pytest

from launch.world_size import processes_per_node


@pytest.mark.parametrize("world, nodes, given, expected", [
    (1, 1, None, 1), (16, 2, None, 8), (16, 4, None, 4), (16, 2, 8, 8), (3, 3, 1, 1),
])
def test_processes_per_node(world, nodes, given, expected):
    assert processes_per_node(world, nodes, given) == expected


@pytest.mark.parametrize("world, nodes, given, message", [
    (6, 4, None, "6 is not divisible by the number of nodes 4"),
    (8, 1, 4, "1 node(s) x 4 processes per node = 4, but the config's trainer world size"),
    (16, 2, 4, "2 node(s) x 4 processes per node = 8"),
    (4, 0, None, "number of nodes must be >= 1, got 0"),
])
def test_processes_that_do_not_fit_are_refused(world, nodes, given, message):
    with pytest.raises(ValueError) as e:
        processes_per_node(world, nodes, given)
    assert message in str(e.value)
