"""The scoreboard (`flashqla-tune bench`, DESIGN.md, "Benchmark protocol"): the runner that times
every implementation on every case, the JIT prewarm, and the report writer. What it measures with
(cases, inputs, timers, accuracy, implementations, floor) is flashqla_tune.measure, shared with the
tuner."""
