"""What the measurements mean: the robust step-time line and intervals (fit), the decomposition and attribution
(analyze, attribution), each point against its physical floor (floor_verdict), the reports of a sweep and of a
trace (sweep_report, trace_report), and results files judged side by side (judge). Reads collected rows and
limit/'s floor; runs nothing."""
