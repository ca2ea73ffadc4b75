"""Fleet logic behind the Functions app: state, rules, history, callback and alerts."""
