"""The control plane's decisions are pinned: replays of a trace prefix must give exactly the plans,
orders, completions, counters and final chunk metadata that the control plane gave before the
ctrlperf optimizations (commit 1e7d69d), recorded below as a digest of everything handed out and
the final counters (``Counters`` field order).

The drivers are ``bench/control_equivalence.py``'s: ``instant`` completes every order ok at once;
``delayed`` completes late and shuffled, fails some orders, reads and plans, holds plans across
requests. A deliberate change of behaviour must re-record these values (and say why); the full
trace against any revision is ``python bench/control_equivalence.py --ref REV``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from saria.control import ControlPlane

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_saria_bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


equivalence = _load("control_equivalence")
bench_control = _load("bench_control")

REQUESTS = 1500

# (trace, config, driver): (digest of the record and final state, final counters), recorded at 1e7d69d.
EXPECTED = {
    ("mooncake", "saria", "instant"): (
        "a53997cb8cc74e62",
        (1500, 41702, 1749, 2792, 37161, 132045078528, 210788941824, 1500, 37161, 2805561556992, 0, 0, 35392, 0,
         5179, 1, 940, 0, 0, 0, 6120, 462044528640, 2792, 210788941824, 0, 183, 13816037376, 0, 0, 30634, 0)),
    ("mooncake", "saria", "delayed"): (
        "77d1c305a0e55cdd",
        (1435, 40375, 1712, 2184, 36479, 129251672064, 164886478848, 1500, 36477, 2753921286144, 0, 1755, 33053,
         0, 4916, 2, 533, 0, 0, 290, 5161, 389642452992, 2206, 166547423232, 6, 285, 21516779520, 1, 0, 29959, 0)),
    ("mooncake", "full-duplicate", "instant"): (
        "135edfe3464463d1",
        (1500, 41702, 1791, 8649, 31262, 135215972352, 652977635328, 1500, 31262, 2360201969664, 0, 0, 29309,
         11731, 0, 0, 0, 31262, 0, 0, 31262, 2360201969664, 8649, 652977635328, 0, 0, 0, 0, 0, 30634, 0)),
    ("mooncake", "full-duplicate", "delayed"): (
        "ee8c6974766cb11f",
        (1437, 39666, 1809, 7899, 29958, 136574926848, 596354531328, 1500, 29958, 2261753266176, 0, 842, 27332,
         10009, 913, 0, 0, 29815, 0, 1166, 29562, 2231856267264, 8014, 605036740608, 22, 180, 13589544960, 11, 0,
         29346, 0)),
    ("mooncake", "lmcache-plus", "instant"): (
        "3184fc187557bb2f",
        (1500, 41702, 1767, 8673, 31262, 133404033024, 654789574656, 1500, 31262, 2360201969664, 0, 0, 29309,
         11731, 0, 0, 0, 31262, 0, 0, 31262, 2360201969664, 8673, 654789574656, 0, 0, 0, 0, 0, 30634, 0)),
    ("mooncake", "lmcache-plus", "delayed"): (
        "054d9bfb1d4fa74c",
        (1447, 40408, 1653, 8346, 30409, 124797321216, 630101901312, 1500, 30409, 2295802626048, 0, 717, 27740,
         10492, 885, 0, 0, 30107, 0, 944, 30048, 2268548038656, 8552, 645654380544, 25, 0, 0, 0, 0, 29676, 0)),
    ("mooncake", "hybrid", "instant"): (
        "b80e29783bb006e2",
        (1500, 41702, 113, 2255, 39334, 2921005056, 60921348096, 1500, 39714, 1095353696256, 0, 0, 39036, 0,
         5745, 1, 845, 0, 0, 0, 6591, 181706686464, 2309, 60921348096, 0, 217, 5460983808, 0, 0, 30634, 0)),
    ("mooncake", "hybrid", "delayed"): (
        "130b763bf41f47fa",
        (1427, 40256, 51, 1533, 38672, 1283457024, 41669885952, 1500, 38768, 1053467738112, 0, 1472, 36665, 0,
         5240, 1, 727, 0, 0, 87, 5881, 160452378624, 1746, 46075674624, 3, 252, 6341787648, 1, 0, 29650, 0)),
    ("mooncake", "saria-small", "instant"): (
        "55d4aed4ed143e10",
        (1500, 41702, 1475, 1903, 38324, 111358771200, 143671689216, 1500, 38279, 2889967730688, 45, 0, 38670,
         3194, 4472, 1, 674, 0, 0, 0, 5147, 388585488384, 1903, 143671689216, 0, 781, 58963525632, 0, 612, 33136,
         22674)),
    ("mooncake", "saria-small", "delayed"): (
        "5ee89a03494a4e56",
        (1440, 40399, 1383, 1853, 37163, 104413003776, 139896815616, 1500, 36904, 2786158706688, 254, 908, 36347,
         2547, 4172, 7, 476, 0, 0, 147, 4508, 340342603776, 1895, 143067709440, 8, 742, 56019124224, 2, 569,
         32274, 21885)),
    ("mooncake", "hybrid-small", "instant"): (
        "30a72bb4d6bb0a94",
        (1500, 41702, 49, 703, 40950, 1233125376, 19468713984, 1500, 39476, 1088634814464, 1980, 0, 39353, 4370,
         4642, 1, 624, 0, 0, 0, 5267, 144948461568, 726, 19468713984, 0, 54, 1358954496, 0, 0, 33686, 24344)),
    ("mooncake", "hybrid-small", "delayed"): (
        "c51f69370c950943",
        (1443, 40448, 14, 610, 39824, 352321536, 16896491520, 1500, 34855, 945667768320, 5205, 1261, 33434, 2646,
         3125, 1, 476, 0, 0, 36, 3566, 95107743744, 630, 16896491520, 0, 18, 452984832, 0, 0, 32928, 24045)),
    ("generated", "saria", "instant"): (
        "0c88ec4343052c3f",
        (1500, 38985, 23890, 5971, 9124, 1803634606080, 450795405312, 1500, 9100, 687026995200, 0, 0, 8886, 0,
         687, 583, 2232, 0, 0, 0, 3502, 264392146944, 5971, 450795405312, 0, 1739, 131290103808, 0, 1659, 5306, 0)),
    ("generated", "saria", "delayed"): (
        "460af7d439bf1fe3",
        (1435, 37308, 22182, 4868, 10258, 1674684923904, 367521693696, 1500, 9570, 722510807040, 0, 274, 8753, 0,
         1257, 588, 1643, 0, 0, 112, 3376, 254879465472, 4971, 375297933312, 29, 1456, 109924319232, 75, 1062,
         5280, 0)),
    ("generated", "hybrid-small", "instant"): (
        "866c05a10be2e048",
        (1500, 38985, 1593, 4535, 32857, 43643437056, 132362010624, 1500, 29489, 810940563456, 0, 0, 29493, 5933,
         4283, 227, 2302, 0, 0, 0, 6812, 189977591808, 4771, 132362010624, 0, 182, 4580179968, 0, 0, 17110, 14765)),
    ("generated", "hybrid-small", "delayed"): (
        "14f26cece9e350df",
        (1428, 37034, 892, 3156, 32986, 24843190272, 92095119360, 1500, 28321, 766645960704, 982, 844, 27451,
         4484, 3552, 210, 1808, 0, 0, 156, 5414, 147762118656, 3482, 96380387328, 14, 141, 3702915072, 12, 0,
         16640, 14313)),
}


def _trace(name: str):
    if name == "mooncake":
        if not equivalence.DEFAULT_TRACE.exists():
            pytest.skip(f"no trace at {equivalence.DEFAULT_TRACE}")
        return equivalence.load_trace(equivalence.DEFAULT_TRACE, REQUESTS)
    return bench_control.generate_trace(requests=REQUESTS, sessions=150)


@pytest.mark.parametrize("trace_name,config,driver", sorted(EXPECTED))
def test_decisions_match_the_recorded_control_plane(trace_name, config, driver):
    trace = _trace(trace_name)
    cp = ControlPlane(equivalence.make_config(config))
    log = equivalence.drive(cp, trace, driver)
    state = equivalence.final_state(cp, trace)
    expected_digest, expected_counters = EXPECTED[trace_name, config, driver]
    assert tuple(equivalence.recorded_counters(cp.counters()).values()) == expected_counters
    assert state[2] == ()  # audit: every invariant holds
    assert equivalence.digest(log + [state])[:16] == expected_digest
