"""A model's Serve replica: the deployment, its engine slot (sleep and wake)."""
