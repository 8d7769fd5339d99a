"""Pipeline parallelism: schedules, a send/recv executor, stage timers (lesson 09)."""
