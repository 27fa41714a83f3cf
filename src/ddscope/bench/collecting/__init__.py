"""What the server and the files say: its responses, counters and log lines read as acceptance (backends,
acceptance_sources, acceptance, server_log), a stream read as steps (stream_steps), and results read back
(results, aiperf). Imports nothing from running/ or judging/."""
