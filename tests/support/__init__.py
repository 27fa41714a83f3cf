"""Test-only code: fakes of real servers built from their sources, virtual time, pool checks, peer gates."""
