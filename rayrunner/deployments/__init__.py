"""Where the model app's builder lived before the replica got its own folder; kept so serve configs that name
`rayrunner.deployments.model_server:build_model_app` still run."""
