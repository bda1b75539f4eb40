"""Stand-ins for what a unit test cannot have for real."""
