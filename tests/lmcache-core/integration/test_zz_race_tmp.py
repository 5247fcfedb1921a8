import sys, os, time
sys.path.insert(0, "/work/main/tests/lmcache-core/integration")
from test_vllm_connector_e2e import *  # noqa

def test_race(lmcache_server, engines):
    srv = lmcache_server()
    e = engines(port=srv.port)
    for i in range(8):
        e.add_request(f"r{i}", tokens(600, seed=70 + i), max_new_tokens=1)
        e.run()
    time.sleep(1)
    print("ACTIVE", active_sessions(srv))
    assert active_sessions(srv) == 0
