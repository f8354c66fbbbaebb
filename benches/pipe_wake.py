"""Reference for ferry bench --idle-conns: the round trip of one byte between
two processes that slept in select() for 1 s (the machine's wake-up floor)."""
import os, time, select
r1, w1 = os.pipe(); r2, w2 = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(w1); os.close(r2)
    while True:
        select.select([r1], [], [])
        b = os.read(r1, 1)
        if not b: os._exit(0)
        os.write(w2, b)
os.close(r1); os.close(w2)
res = []
for i in range(5):
    time.sleep(1.0)
    t = time.perf_counter(); os.write(w1, b'x'); os.read(r2, 1); res.append((time.perf_counter() - t) * 1e6)
os.close(w1); os.waitpid(pid, 0)
print("pipe round trip after 1 s idle, us:", " ".join(f"{x:.0f}" for x in res))
