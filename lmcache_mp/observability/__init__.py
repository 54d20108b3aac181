"""What the daemon tells its operators: Prometheus metrics (`metrics.py`) and the HTTP endpoint that
serves them (`http.py`)."""
