import httpx, pytest, os, subprocess

@pytest.mark.e2e
def test_colocated(colocated_server):
    r = httpx.post(f"{colocated_server.url}/v1/completions", json={"model": colocated_server.model, "prompt": "hi there", "max_tokens": 8, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    print("PGID members", subprocess.run(["ps", "-o", "pid,pgid,comm", "-g", str(colocated_server.process.pid)], capture_output=True, text=True).stdout)
    open("/tmp/colo_pid", "w").write(str(colocated_server.process.pid))
