"""Settings, database engine, security and task dispatch of the control plane."""
