"""The step loop: a pure planner, a model runner that carries its plans out, and the loop that drives them."""
