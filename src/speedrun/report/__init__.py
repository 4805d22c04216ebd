"""Run records and environment descriptions."""
