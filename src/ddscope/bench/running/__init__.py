"""The experiment run against a server: prompt sets and the tokenizer that sizes them (workloads), the context
sweep (sweep), the streamed trace (trace), loops found in each response (loops), the server itself (server), the
run's folder (run_folder), and the commands that run them and hand the rows to judging (commands)."""
