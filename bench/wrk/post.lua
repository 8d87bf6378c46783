-- wrk script for bench/serve.py: POST one prepared body, report the summary as one JSON line.
-- Settings come from the environment: BENCH_BODY (file), BENCH_HEADERS ("Name: value|Name: value").
local body_file = assert(io.open(os.getenv("BENCH_BODY"), "rb"))
wrk.method = "POST"
wrk.body = body_file:read("*all")
body_file:close()
for pair in string.gmatch(os.getenv("BENCH_HEADERS") or "", "[^|]+") do
  local name, value = string.match(pair, "^%s*(.-)%s*:%s*(.-)%s*$")
  wrk.headers[name] = value
end

-- No `response` callback: with one, wrk copies every answer's headers and body into Lua strings,
-- which made wrk, not the server, the bottleneck for large answers. Statuses above 399 are
-- counted by wrk itself (summary.errors.status).

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '{"requests": %d, "duration_us": %d, "p50_us": %.1f, "p90_us": %.1f, "p99_us": %.1f, "max_us": %.1f, ' ..
    '"status_errors": %d, "socket_errors": %d}\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency.max, e.status, e.connect + e.read + e.write + e.timeout))
end
