"""Several proxies in front of the same upstreams: leases that give each upstream to one proxy
at a time (leases.py, their SQL; plan.py, what a proxy claims, pure; keeper.py, the background
task), and the hand-off of a request to the proxy its conversation belongs to (handoff.py)."""
