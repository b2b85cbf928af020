"""D2RH (decode to remote host): KV staged in D's host pool, scheduler and worker sides."""
