// A test agent on the JDK's own HTTP clients, which ignore HTTPS_PROXY: `java JavaAgent.java MODE...`.
// Each MODE is one chat call to https://api.openai.com (the answer's content is printed):
//   httpclient   java.net.http.HttpClient.newHttpClient(), as LangChain4j and Spring AI use it
//   urlconnection  java.net.HttpURLConnection
import java.io.InputStream;
import java.net.HttpURLConnection;
import java.net.URI;
import java.net.URL;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.nio.charset.StandardCharsets;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

public class JavaAgent {
    static final String URL_ = "https://api.openai.com/v1/chat/completions";
    static final String BODY = "{\"model\":\"gpt-4o-mini\",\"messages\":[{\"role\":\"user\",\"content\":\"hi from java\"}]}";

    static String content(String json) {
        Matcher m = Pattern.compile("\"content\": ?\"([^\"]*)\"").matcher(json);
        return m.find() ? m.group(1) : json;
    }

    public static void main(String[] args) throws Exception {
        for (String mode : args) {
            String answer;
            if (mode.equals("httpclient")) {
                HttpClient client = HttpClient.newHttpClient();
                HttpRequest request = HttpRequest.newBuilder(URI.create(URL_))
                    .header("Content-Type", "application/json")
                    .header("Authorization", "Bearer " + System.getenv().getOrDefault("OPENAI_API_KEY", "sk-none"))
                    .POST(HttpRequest.BodyPublishers.ofString(BODY)).build();
                answer = client.send(request, HttpResponse.BodyHandlers.ofString()).body();
            } else {
                HttpURLConnection conn = (HttpURLConnection) new URL(URL_).openConnection();
                conn.setRequestMethod("POST");
                conn.setDoOutput(true);
                conn.setRequestProperty("Content-Type", "application/json");
                conn.getOutputStream().write(BODY.getBytes(StandardCharsets.UTF_8));
                try (InputStream in = conn.getResponseCode() < 400 ? conn.getInputStream() : conn.getErrorStream()) {
                    answer = new String(in.readAllBytes(), StandardCharsets.UTF_8);
                }
            }
            System.out.println(mode + ": " + content(answer));
        }
    }
}
